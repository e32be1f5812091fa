"""An image folder: JPEG bytes shared and decoded in the worker, against decoded images.

Writes a few hundred JPEG files with PIL (``root/<class>/<n>.jpg``, smooth images with
some noise, about the compression of photographs), then runs each case in a fresh
interpreter, the cases alternated within each repetition so that a noisy neighbour hits
all of them:

* ``JPEG bytes, decoded in the worker``: ``sd.SharedDataset(folder of (file bytes,
  label))`` with ``transform=`` decoding with PIL, then cropping and flipping at random
  (the recipe of docs/tutorials/migrate.md);
* ``decoded PIL images (ImageFolder's default)``: ``sd.SharedDataset(folder of
  (PIL image, label))``, the images kept pickled, ``transform=`` converts, crops, flips;
* ``decoded uint8 tensors``: the folder decoded to ``[3, H, W]`` tensors once, the
  transform crops and flips only.

Each: the bytes in shared memory (``ds.nbytes``), the time to wrap, samples/s through
``DataLoader(batch_size=32, shuffle=True, num_workers=2, persistent_workers=True)``
(fork, two epochs after a warm-up epoch) and the PSS of the main process and each worker
after an epoch (``sd.verify``, which also gives the processes' total).

    .venv/bin/python benchmarks/bench_images.py              # ~3 min on 2 cores
    .venv/bin/python benchmarks/bench_images.py --quick      # 60 images, 1 repetition

Writes ``benchmarks/results/images.md`` and ``.json`` (``--out-dir`` to change;
``--render results/images.json`` prints the table again).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH, HEIGHT, CROP = 320, 240, 192

PRELUDE = """
import io, json, os, pathlib, time, warnings
warnings.simplefilter("ignore")
import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
import shareddata as sd
ROOT = pathlib.Path({root!r})
CROP = {crop}


class Folder(Dataset):
    '''ImageFolder's listing: (load(path), class index) over ROOT/<class>/*.jpg.'''
    def __init__(self, load):
        classes = sorted(p.name for p in ROOT.iterdir())
        self.samples = [(p, c) for c, name in enumerate(classes)
                        for p in sorted((ROOT / name).glob("*.jpg"))]
        self.load = load
    def __len__(self):
        return len(self.samples)
    def __getitem__(self, i):
        path, label = self.samples[i]
        return self.load(path), label


def read_bytes(path):
    return path.read_bytes()


def decode_pil(path):
    with Image.open(path) as image:
        return image.convert("RGB")


def to_tensor(image):
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)


def decode_tensor(path):
    return to_tensor(decode_pil(path))


def augment(image):
    y = int(torch.randint(0, image.shape[1] - CROP + 1, ()))
    x = int(torch.randint(0, image.shape[2] - CROP + 1, ()))
    image = image[:, y:y + CROP, x:x + CROP]
    return image.flip(-1) if torch.rand(()) < 0.5 else image


def from_bytes(item):
    data, label = item
    with Image.open(io.BytesIO(data)) as image:
        return augment(to_tensor(image.convert("RGB"))), label


def from_pil(item):
    image, label = item
    return augment(to_tensor(image)), label


def from_tensor(item):
    image, label = item
    return augment(image), label


def measure(load, transform):
    t = time.perf_counter()
    ds = sd.SharedDataset(Folder(load), transform=transform, progress=False)
    wrap_s = time.perf_counter() - t
    loader = DataLoader(ds, batch_size=32, shuffle=True, num_workers=2,
                        persistent_workers=True, multiprocessing_context="fork")
    for _ in loader:  # warm-up: starts the workers, touches the pages
        pass
    t, n = time.perf_counter(), 0
    for _ in range(2):
        for images, labels in loader:
            n += len(labels)
    samples_s = n / (time.perf_counter() - t)
    report = sd.verify(loader, max_duplication=None)
    rows = [{{"role": p.role, "pss": p.pss}} for p in report.processes]
    print(json.dumps({{"nbytes": ds.nbytes, "wrap_s": wrap_s, "samples_s": samples_s,
                      "total_pss": report.total_pss, "processes": rows}}))
"""

CASES: dict[str, str] = {
    "JPEG bytes, decoded in the worker": "measure(read_bytes, from_bytes)",
    "decoded PIL images (ImageFolder's default)": "measure(decode_pil, from_pil)",
    "decoded uint8 tensors": "measure(decode_tensor, from_tensor)",
}


def prepare(root: str, count: int) -> int:
    """``count`` JPEG files in two classes; their total size in bytes."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH] / max(WIDTH, HEIGHT)
    total = 0
    for i in range(count):
        folder = os.path.join(root, ("cat", "dog")[i % 2])
        os.makedirs(folder, exist_ok=True)
        waves = [
            np.sin(
                2 * np.pi * (rng.uniform(0.5, 4) * x + rng.uniform(0.5, 4) * y) + rng.uniform(0, 6)
            )
            for _ in range(3)
        ]
        pixels = np.stack(waves, -1) * 90 + 128 + rng.normal(0, 6, (HEIGHT, WIDTH, 3))
        path = os.path.join(folder, f"{i}.jpg")
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(path, quality=90)
        total += os.path.getsize(path)
    return total


def run_case(code: str, root: str, timeout: float) -> dict:
    """Run ``code`` after the prelude, as a script in a fresh interpreter."""
    script = PRELUDE.format(root=root, crop=CROP) + '\nif __name__ == "__main__":\n'
    script += textwrap.indent(code, "    ") + "\n"
    file = os.path.join(os.path.dirname(root), "case.py")
    with open(file, "w") as f:
        f.write(script)
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, file], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"case failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _pss(runs: list[dict], role: str) -> float:
    """The median PSS of the processes of ``role`` (a worker: their mean in each run)."""
    per_run = []
    for r in runs:
        values = [p["pss"] for p in r["processes"] if p["role"].startswith(role)]
        per_run.append(sum(values) / len(values))
    return statistics.median(per_run)


def render(results: dict) -> str:
    runs, mib = results["runs"], 1 << 20
    base = runs["JPEG bytes, decoded in the worker"]
    b_bytes, b_rate = _median(base, "nbytes"), _median(base, "samples_s")
    b_pss = _median(base, "total_pss")
    lines = [
        "# An image folder: JPEG bytes decoded in the worker against decoded images",
        "",
        f"{results['images']} JPEG files of {WIDTH}x{HEIGHT} (quality 90, "
        f"{results['jpeg_bytes'] / mib:.1f} MiB in all), two classes; random {CROP}x{CROP} "
        "crop and flip in `transform=`; `DataLoader(batch_size=32, shuffle=True, "
        "num_workers=2, persistent_workers=True)`, fork; samples/s over two epochs after a "
        "warm-up epoch (median, range); PSS after an epoch (`sd.verify`), net of nothing: "
        f"each process's interpreter and torch included. Medians of {results['reps']} "
        f"repetitions, each case in a fresh interpreter ({results['when']}, load average "
        f"{results['load']}). Produced by `{results['command']}`.",
        "",
        "| form in shared memory | shared bytes | x JPEG bytes' | wrap time | samples/s | "
        "x bytes' | PSS main / per worker | PSS total | above bytes' |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, rs in runs.items():
        nbytes, rate = _median(rs, "nbytes"), _median(rs, "samples_s")
        rates = [r["samples_s"] for r in rs]
        total = _median(rs, "total_pss")
        lines.append(
            f"| {name} | {nbytes / mib:.1f} MiB | {nbytes / b_bytes:.2f}x | "
            f"{_median(rs, 'wrap_s'):.2f} s | {rate:.0f} ({min(rates):.0f}-{max(rates):.0f}) | "
            f"{rate / b_rate:.2f}x | "
            f"{_pss(rs, 'main') / mib:.0f} / {_pss(rs, 'worker') / mib:.0f} MiB | "
            f"{total / mib:.0f} MiB | {(total - b_pss) / mib:+.0f} MiB |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 images, 1 repetition")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--out-dir", default=os.path.join(REPO, "benchmarks", "results"))
    parser.add_argument("--render", metavar="JSON", help="print the table of saved results")
    args = parser.parse_args()
    if args.render:
        with open(args.render) as f:
            print(render(json.load(f)))
        return
    count, reps = (60, 1) if args.quick else (args.images, args.reps)
    with tempfile.TemporaryDirectory(prefix="bench-images") as tmp:
        root = os.path.join(tmp, "images")
        jpeg_bytes = prepare(root, count)
        runs: dict[str, list[dict]] = {name: [] for name in CASES}
        loads = [os.getloadavg()[0]]
        for rep in range(reps):
            for name, code in CASES.items():
                runs[name].append(run_case(code, root, timeout=900))
                print(f"rep {rep + 1}/{reps} {name}: {runs[name][-1]}", flush=True)
                loads.append(os.getloadavg()[0])
    results = {
        "images": count, "jpeg_bytes": jpeg_bytes, "reps": reps, "runs": runs,
        "load": f"{min(loads):.1f}-{max(loads):.1f}",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python benchmarks/bench_images.py" + (" --quick" if args.quick else ""),
    }  # fmt: skip
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "images.json"), "w") as f:
        json.dump(results, f, indent=1)
    page = render(results)
    with open(os.path.join(args.out_dir, "images.md"), "w") as f:
        f.write(page)
    print(page)


if __name__ == "__main__":
    main()
