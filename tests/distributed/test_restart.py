"""Elastic restarts: a rank killed mid-epoch restarts the group, which loads afresh.

``torchrun --max-restarts=1`` in a private ``/dev/shm`` (tests/distributed/scripts/restart.py):
local rank 1 SIGKILLs itself mid-epoch in incarnation 0; the agent restarts both
ranks; the new incarnation shares one new segment (node sharing keys on
``TORCHELASTIC_RESTART_COUNT``: never the dead incarnation's), finishes its epoch
with the right values, and nothing is left in ``/dev/shm`` or held by any process.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
from conftest import REPO, holders, run_isolated


def test_a_rank_killed_mid_epoch_restarts_the_group_on_fresh_segments(tmp_path):
    np.save(tmp_path / "data.npy", np.arange(4096 * 64, dtype=np.float32).reshape(4096, 64))
    out = tmp_path / "out"
    out.mkdir()
    script = os.path.join(REPO, "tests", "distributed", "scripts", "restart.py")
    run = run_isolated(
        f"""
        import os, subprocess, sys
        ours = ("LOCAL_", "RANK", "WORLD_", "GROUP_", "MASTER_", "TORCHELASTIC")
        env = {{k: v for k, v in os.environ.items() if not k.startswith(ours)}}
        env["OMP_NUM_THREADS"] = "1"
        job = subprocess.run(
            [{sys.executable!r}, "-m", "torch.distributed.run", "--standalone",
             "--nproc_per_node=2", "--max-restarts=1", "--monitor-interval=0.2",
             {script!r}, {str(tmp_path / "data.npy")!r}, {str(out)!r}],
            env=env, capture_output=True, text=True, timeout=150,
        )
        print("RC", job.returncode)
        print(job.stderr[-3000:], file=sys.stderr)
        """,
        timeout=180,
    )
    assert "RC 0" in run.stdout, run.stdout + run.stderr
    reports = {p.name: json.loads(p.read_text()) for p in out.iterdir()}
    assert set(reports) == {
        "inc0-rank0.json",
        "inc0-rank1.json",
        "inc1-rank0.json",
        "inc1-rank1.json",
    }
    old, new = reports["inc0-rank0.json"], reports["inc1-rank0.json"]
    assert len(old["segments"]) == 1 and len(new["segments"]) == 1, reports
    assert not old["done"] and not reports["inc0-rank1.json"]["done"]  # killed mid-epoch
    assert reports["inc0-rank1.json"]["segments"] == old["segments"]  # one copy per node
    assert reports["inc1-rank1.json"]["segments"] == new["segments"]  # again, after the restart
    assert new["segments"] != old["segments"]  # never the dead incarnation's segment
    assert all(reports[f"inc1-rank{r}.json"]["done"] for r in (0, 1))
    assert all(reports[f"inc1-rank{r}.json"]["correct"] for r in (0, 1))
    segments = {tuple(s) for r in reports.values() for s in r["segments"]}
    deadline = time.monotonic() + 10  # orphaned DataLoader workers notice within ~5 s
    while holders(segments) and time.monotonic() < deadline:  # type: ignore[arg-type]
        time.sleep(0.2)
    assert not holders(segments), holders(segments)  # type: ignore[arg-type]
    assert run.leftovers == []
