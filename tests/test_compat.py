"""Every private torch/numpy surface of ``shareddata/_compat.py`` still does what we rely on.

When a torch or numpy release changes one of them, the test of that surface fails,
naming it: that is the place to adapt (``scripts/compat.sh`` runs the suite against
the oldest and newest torch the package claims).
"""

from __future__ import annotations

import gc
import io
import uuid

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import shareddata as sd
from shareddata import _compat


def test_disabled_torch_function_makes_every_result_plain():
    class Marked(torch.Tensor):
        __torch_function__ = _compat.disabled_torch_function

    t = torch.arange(4).as_subclass(Marked)
    assert type(t + 1) is torch.Tensor and type(t[1:]) is torch.Tensor


def test_disable_torch_function_subclass_runs_the_plain_operation():
    class Loud(torch.Tensor):
        calls = 0

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.calls += 1
            with _compat.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))

    t = torch.arange(4).as_subclass(Loud)
    assert type(t * 2) is torch.Tensor and Loud.calls >= 1


def test_view_base_is_the_tensor_a_view_was_made_from():
    t = torch.arange(6)
    rows = t.view(2, 3).unbind(0)
    assert _compat.view_base(rows[1]) is not None
    assert _compat.view_base(rows[1]).data_ptr() == t.data_ptr()
    assert _compat.view_base(t) is None


def test_torchs_reducers_rebuild_a_tensor_and_a_storage():
    t = torch.arange(5.0)
    rebuild, args = _compat.torch_reduce_tensor(t.clone())
    assert torch.equal(rebuild(*args), t)
    rebuild, args = _compat.torch_reduce_storage(t.clone().untyped_storage())
    assert bytes(rebuild(*args)) == bytes(t.untyped_storage())


def test_collate_registry_dispatches_on_a_registered_type():
    class Mine(int):
        pass

    _compat.default_collate_fn_map[Mine] = lambda batch, *, collate_fn_map=None: "mine"
    try:
        assert torch.utils.data.default_collate([Mine(1), Mine(2)]) == "mine"
        assert _compat.collate([Mine(1)], collate_fn_map=_compat.default_collate_fn_map) == "mine"
    finally:
        del _compat.default_collate_fn_map[Mine]


def test_the_registry_holds_torchs_own_collate_functions():
    # a worker's collate into one memfd (crossing/_collate.py) recognises them
    fns = _compat.default_collate_fn_map
    assert fns[torch.Tensor] is _compat.collate_tensor_fn
    assert fns[np.ndarray] is _compat.collate_numpy_array_fn
    assert fns[(np.bool_, np.number, np.object_)] is _compat.collate_numpy_scalar_fn
    assert fns[float] is _compat.collate_float_fn and fns[int] is _compat.collate_int_fn
    assert fns[str] is _compat.collate_str_fn and fns[bytes] is _compat.collate_str_fn
    out = torch.empty(2, 3)
    batch = [torch.ones(3), torch.zeros(3)]
    assert torch.equal(torch.stack(batch, 0, out=out), _compat.collate_tensor_fn(batch))
    assert _compat.collate_int_fn([1, 2]).dtype == torch.int64
    assert _compat.collate_float_fn([1.0]).dtype == torch.float64


def test_only_shareddata_types_are_registered_for_the_default_collate():
    types = [t for t in _compat.default_collate_fn_map if isinstance(t, type)]
    ours = [t for t in types if t.__module__.startswith("shareddata")]
    assert ours and uuid.UUID not in _compat.default_collate_fn_map


def test_npy_version_3_headers_are_read():
    buf = io.BytesIO()
    array = np.zeros(3, dtype=[("é", np.int32)])  # a non-latin-1 field name: version 3.0
    np.lib.format.write_array(buf, array, version=(3, 0))
    buf.seek(0)
    assert np.lib.format.read_magic(buf) == (3, 0)
    shape, fortran, dtype = _compat.read_npy_header_3(buf)
    assert shape == (3,) and not fortran and dtype == array.dtype


@pytest.mark.parametrize("persistent", [True, False])
def test_a_dataloaders_workers_can_be_stopped_and_its_progress_read(persistent):
    ds = sd.NumpyDataset(np.arange(64, dtype=np.float32))
    loader = DataLoader(
        ds, batch_size=8, num_workers=1, persistent_workers=persistent,
        multiprocessing_context="fork", timeout=30,
    )  # fmt: skip
    it = iter(loader)
    next(it)
    progress = _compat.dataloader_progress(loader)
    pids = _compat.dataloader_worker_pids(it)
    assert pids and all(isinstance(p, int) for p in pids)
    if persistent:
        assert progress == (1, 8)
        workers = list(it._workers)
        _compat.stop_dataloader_workers(loader)
        assert loader._iterator is None
        for w in workers:
            w.join(10)
            assert not w.is_alive()
    else:
        assert progress is None  # a non-persistent loader keeps no iterator
        _compat.shutdown_dataloader_iterator(it)
        assert not any(w.is_alive() for w in it._workers)
    del it


def test_coo_parts_are_the_tensors_a_sparse_tensor_was_built_from():
    indices, values = torch.tensor([[0, 0, 2]]), torch.tensor([1.0, 2.0, 3.0])
    t = torch.sparse_coo_tensor(indices, values, (3,), check_invariants=False)
    got_i, got_v = _compat.coo_parts(t)
    assert got_i.data_ptr() == indices.data_ptr() and got_v.data_ptr() == values.data_ptr()


def test_make_subclass_takes_sparse_tensors():
    from shareddata.storage import SharedTensor

    t = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (3,), check_invariants=False)
    sub = _compat.make_subclass(SharedTensor, t)
    assert type(sub) is SharedTensor and sub.layout is torch.sparse_coo
    assert torch.equal(sub.to_dense(), torch.tensor([1.0, 0.0, 2.0]))


def test_new_views_are_retyped_in_place_not_aliased():
    # the fast path (Python's __class__ assignment on a tensor): if a torch release
    # refuses it, retype_new_views falls back to as_subclass, one alias per row (~1 us)
    rows = list(torch.arange(12.0).view(4, 3).unbind(0))
    ids = [id(r) for r in rows]
    out = _compat.retype_new_views(rows, sd.SharedTensor)
    assert [id(r) for r in out] == ids
    assert all(type(r) is sd.SharedTensor for r in out)
    assert out[2].tolist() == [6.0, 7.0, 8.0] and type(out[2] + 1) is torch.Tensor
    del rows, out
    gc.collect()  # freed as any tensor is (no crash in the subclass's dealloc)


def test_rows_of_a_batch_hold_no_reference_and_still_cross_by_handle():
    # a row made by unbind finds its memory through its base (storage/_tensor.memory_ref):
    # no dict per row, and a row pickles by handle (a few hundred bytes), not by value
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import numpy as np

    batch = sd.SharedArray.from_array(np.arange(4096.0).reshape(4, 1024)).torch()
    rows = batch.unbind(0)
    assert all(type(r) is sd.SharedTensor and "_shared" not in r.__dict__ for r in rows)
    sent = bytes(ForkingPickler.dumps(rows[2][10:]))
    assert len(sent) < 1000  # the row by value would be 8 KiB
    got = pickle.loads(sent)
    assert type(got) is torch.Tensor and got.tolist() == list(range(2058, 3072))
