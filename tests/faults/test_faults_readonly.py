"""Read-only data: a worker's write to the dataset's memory is refused or stays its own.

Worker 0 of a DataLoader tries to write rows 0-4 (see ``faultjobs.try_writes``);
then worker 1 and the main process read them. Every process maps the data
copy-on-write (``MAP_PRIVATE``): spawn and forkserver workers when they attach, and
the loading process once it has filled the dataset, so ``fork`` workers inherit a
copy-on-write mapping too. An ordinary write is refused; a forced one
(``flags.writeable = True``, the column's torch view, the raw mapping) stays in the
writer.
"""

from __future__ import annotations

import functools
import json
import multiprocessing as mp

import numpy as np
import pytest
from conftest import START_METHODS
from faultjobs import try_writes
from torch.utils.data import DataLoader

import shareddata as sd


@pytest.mark.parametrize("method", START_METHODS)
def test_a_workers_write_cannot_change_what_others_read(method, tmp_path):
    ctx = mp.get_context(method)
    ds = sd.NumpyDataset({"x": np.arange(64, dtype=np.int64)})
    barrier = ctx.Barrier(2)
    loader = DataLoader(
        ds,
        batch_sampler=[list(range(8)), list(range(8))],  # batch 0: worker 0, batch 1: worker 1
        num_workers=2,
        multiprocessing_context=ctx,
        worker_init_fn=functools.partial(try_writes, barrier, str(tmp_path / "writer.json")),
    )
    seen = [b["x"][:5].tolist() for b in loader]
    writer = json.loads((tmp_path / "writer.json").read_text())
    assert writer["numpy"] == "refused"  # the column's array is read-only
    assert writer["sample_then"] == 1  # samples are copies
    assert writer["flag"] == "written"  # numpy lets the flag be set back on a mapping
    assert writer["own_view"] == [0, 1, -2, -3, -4]  # the writer sees its forced writes
    parent = ds._columns["x"].arrays["data"].numpy()[:5].tolist()
    assert seen[0] == [0, 1, -2, -3, -4]  # worker 0's own batch: private copy-on-write pages
    assert seen[1] == [0, 1, 2, 3, 4]  # worker 1 is unaffected
    assert parent == [0, 1, 2, 3, 4]  # and so is the main process
