"""HDF5 links: external links load like any dataset (relative to the linking file, as
h5py resolves them) and are part of the default selection; soft links stay out of it
(their target is loaded under its own name); a broken link names itself."""

import os
import warnings

import h5py
import numpy as np
import pytest
from torch.utils.data import DataLoader

import shareddata as sd
from shareddata import HDF5Dataset


@pytest.fixture
def linked(tmp_path):
    """data/a.h5 links to data/parts/b.h5 (relative), as a dataset and as a group."""
    (tmp_path / "data" / "parts").mkdir(parents=True)
    with h5py.File(tmp_path / "data" / "parts" / "b.h5", "w") as f:
        f["ext_data"] = np.arange(40, dtype=np.int32).reshape(20, 2)
        f.create_dataset("g/y", data=np.linspace(0, 1, 20), chunks=(5,), compression="gzip")
    a = tmp_path / "data" / "a.h5"
    with h5py.File(a, "w") as f:
        f["x"] = np.arange(20.0)
        f["ext"] = h5py.ExternalLink("parts/b.h5", "/ext_data")
        f["extg"] = h5py.ExternalLink("parts/b.h5", "/g")
        f["soft"] = h5py.SoftLink("/x")
    return a


def test_external_links_load_and_are_in_the_default_selection(linked, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the linking file's folder: resolved next to it
    ds = HDF5Dataset(linked, progress=False)
    assert ds.columns == ["x", "ext", "extg/y"]  # the soft link's target is 'x' already
    batch = ds[list(range(20))]
    np.testing.assert_array_equal(batch["ext"].numpy(), np.arange(40).reshape(20, 2))
    np.testing.assert_array_equal(batch["extg/y"].numpy(), np.linspace(0, 1, 20))
    keyed = HDF5Dataset(linked, ["ext", "soft"], progress=False)
    assert keyed[3]["ext"].tolist() == [6, 7] and keyed[3]["soft"].item() == 3.0
    loader = DataLoader(keyed, batch_size=5, num_workers=1, multiprocessing_context="spawn",
                        timeout=60)  # fmt: skip
    assert sum(int(b["ext"].sum()) for b in loader) == sum(range(40))


def test_a_broken_external_link_is_named_never_a_raw_key_error(linked):
    with h5py.File(linked, "a") as f:
        f["gone"] = h5py.ExternalLink("parts/nope.h5", "/d")
        f["wrong"] = h5py.ExternalLink("parts/b.h5", "/missing")
    where = os.path.join(os.path.dirname(linked), "parts", "nope.h5")
    with pytest.raises(sd.MissingFileError, match=rf"'gone' is an external link.*{where}"):
        HDF5Dataset(linked, ["gone"])
    with pytest.raises(sd.MissingColumnError, match=r"'wrong' is an external link.*'/missing'"):
        HDF5Dataset(linked, ["wrong"])
    with pytest.warns(UserWarning) as caught:
        ds = HDF5Dataset(linked, progress=False)
    said = " ".join(str(w.message) for w in caught)
    assert "'gone' is an external link" in said and "'wrong' is an external link" in said
    assert ds.columns == ["x", "ext", "extg/y"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HDF5Dataset(linked, ["x"], progress=False)  # nothing to say when not selected
