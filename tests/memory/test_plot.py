"""MemoryReport.plot and `demo --plot`: the bars drawn are the report's figures."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO
from torch.utils.data import DataLoader, TensorDataset

import shareddata as sd
from shareddata.memory import _plot

MIB = 1 << 20


def _report(rows, dataset_mib=64, duplication=1.0):
    processes = [
        sd.ProcessMemory(
            pid=100 + i, role=role, rss=(u + s) * MIB, uss=u * MIB, pss=u * MIB, shared=s * MIB
        )
        for i, (role, u, s) in enumerate(rows)
    ]
    return sd.MemoryReport(
        dataset_bytes=dataset_mib * MIB,
        total_pss=sum(p.pss for p in processes),
        duplication=duplication,
        processes=processes,
        baseline_bytes=0,
        start_method="spawn",
        num_workers=len(rows) - 1,
    )


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_bars_are_private_and_shared_memory_per_process():
    naive = _report([("main", 300, 20), ("worker 0", 210, 10), ("worker 1", 205, 15)], 64, 2.9)
    shared = _report([("main", 240, 80), ("worker 0", 150, 70), ("worker 1", 149, 71)], 64, 1.0)
    fig = _plot.figure([("naive", naive), ("shared", shared)])
    axes = fig.axes
    assert len(axes) == 2
    for ax, report in zip(axes, (naive, shared)):
        bars = [(p.get_x() + p.get_width() / 2, p.get_y(), p.get_height()) for p in ax.patches]
        private, on_top = bars[: len(report.processes)], bars[len(report.processes) :]
        assert [h for _, _, h in private] == [p.uss / MIB for p in report.processes]
        assert [y for _, y, _ in private] == [0] * len(report.processes)
        assert [h for _, _, h in on_top] == [p.shared / MIB for p in report.processes]
        assert [y for _, y, _ in on_top] == [p.uss / MIB for p in report.processes]
        assert [x for x, _, _ in private] == [x for x, _, _ in on_top]  # stacked
        labels = [t.get_text() for t in ax.get_xticklabels()]
        assert labels == [p.role for p in report.processes]
        (line,) = ax.get_lines()
        assert list(line.get_ydata()) == [64, 64]  # the dataset's size
    assert "2.90x" in axes[0].get_title() and "1.00x" in axes[1].get_title()
    assert axes[0].get_ylim() == axes[1].get_ylim()  # comparable at a glance


def test_plot_writes_a_png_of_a_real_report(tmp_path):
    loader = DataLoader(TensorDataset(torch.zeros(256, 64)), batch_size=32)
    report = sd.verify(loader, max_duplication=None)
    out = report.plot(tmp_path / "memory.png", title="my loader")
    assert out == tmp_path / "memory.png"
    assert _png_size(out.read_bytes()) == (400, 500)  # one process: 4 x 5 inches at 100 dpi
    image = _read_rgb(out)
    assert _count(image, _plot.PRIVATE_COLOR) > 1000  # the main process's bar is drawn
    assert _count(image, _plot.SHARED_COLOR) > 100


def _read_rgb(path):
    from matplotlib.image import imread

    return (imread(path)[..., :3] * 255).round().astype(np.int16)


def _count(image, color: str) -> int:
    rgb = np.array([int(color[i : i + 2], 16) for i in (1, 3, 5)], np.int16)
    return int(np.all(np.abs(image - rgb) <= 2, axis=-1).sum())


def test_missing_matplotlib_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'torch-shareddata\[plot\]'") as err:
        _report([("main", 10, 10)]).plot(tmp_path / "x.png")
    assert isinstance(err.value, sd.MissingDependencyError)
    assert not (tmp_path / "x.png").exists()


def test_demo_without_matplotlib_fails_before_running(tmp_path):
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from shareddata.cli import main\n"
        f"sys.exit(main(['demo', '--size', '1MiB', '--plot', {str(tmp_path / 'd.png')!r}]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'torch-shareddata[plot]'" in proc.stderr
    assert "writing a synthetic" not in proc.stdout  # failed before any work


def test_demo_plot_shows_the_naive_copies(tmp_path):
    png = tmp_path / "demo.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shareddata",
            "demo",
            "--size",
            "32MiB",
            "--workers",
            "1",
            "--start-method",
            "spawn",
            "--batches",
            "5",
            "--plot",
            str(png),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"chart written to {png}" in proc.stdout
    width, height = _png_size(png.read_bytes())
    assert width == 2 * 400 and height == 500  # two panels of 2 processes
    image = _read_rgb(png)
    naive, shared = image[:, : width // 2], image[:, width // 2 :]
    # the naive worker holds its own 32 MiB copy: more private (red) area on the left
    assert _count(naive, _plot.PRIVATE_COLOR) > 1.1 * _count(shared, _plot.PRIVATE_COLOR)
    assert _count(shared, _plot.SHARED_COLOR) > _count(naive, _plot.SHARED_COLOR)
