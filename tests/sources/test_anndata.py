"""AnnData (.h5ad) files and sparse matrices in HDF5, written by the real tools.

Every file is written by anndata (or, for layouts anndata no longer writes, by h5py in
that layout: 10x Genomics' ``matrix`` group, the older ``h5sparse`` attributes) and
read back cell by cell against ``anndata.read_h5ad`` (or scipy), value by value, in
this process and in DataLoader workers. :func:`compare` makes the per-file table
(``python tests/sources/test_anndata.py`` prints it).
"""

import sys
import warnings

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import shareddata as sd
from shareddata import HDF5Dataset
from shareddata.datasets._load import build
from shareddata.sources.hdf5 import HDF5Source

ad = pytest.importorskip("anndata")
pd = pytest.importorskip("pandas")
sp = pytest.importorskip("scipy.sparse")

CELLS, GENES = 203, 37


def _adata(x_format="csr", seed=0):
    rng = np.random.default_rng(seed)
    counts = sp.random(CELLS, GENES, density=0.1, format="csr", dtype=np.float32, random_state=seed)
    counts.data = np.round(counts.data * 20) + 1
    x = {"csr": counts, "csc": counts.tocsc(), "dense": counts.toarray(), "none": None}[x_format]
    obs = pd.DataFrame(
        {
            "cell_type": pd.Categorical(rng.choice(["B", "T", "NK", "Mono"], CELLS)),
            "n_genes": rng.integers(0, 5000, CELLS),
            "pct_mito": rng.random(CELLS).astype(np.float32),
            "is_doublet": rng.random(CELLS) > 0.9,
            "donor": [f"donor{i % 3}" for i in range(CELLS)],  # written as a categorical
            "batch": pd.array(np.arange(CELLS) % 4, dtype="Int64"),  # nullable, no NA
        },
        index=pd.Index([f"AAAC{i:05d}-1" for i in range(CELLS)], name="barcode"),
    )
    obs.loc[obs.index[::17], "cell_type"] = np.nan  # missing categories: code -1
    var = pd.DataFrame({"gene_ids": [f"ENSG{i:05d}" for i in range(GENES)]},
                       index=[f"GENE{i}" for i in range(GENES)])  # fmt: skip
    adata = ad.AnnData(X=x, obs=obs, var=var)
    adata.obsm["X_pca"] = rng.standard_normal((CELLS, 5)).astype(np.float32)
    adata.obsm["X_umap"] = rng.standard_normal((CELLS, 2))
    adata.layers["counts"] = counts.copy()
    adata.obsp["distances"] = sp.random(CELLS, CELLS, density=0.02, format="csr", random_state=1)
    adata.uns["log1p"] = {"base": None}
    return adata


def make_files(root):
    """Every file of the suite, written under ``root``: {path: the tool that wrote it}."""
    made = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anndata's own FutureWarnings: not ours
        for x_format in ("csr", "csc", "dense"):
            _adata(x_format).write_h5ad(root / f"{x_format}.h5ad")
            made[f"{x_format}.h5ad"] = "anndata"
        _adata("csr").write_h5ad(root / "csr-gzip.h5ad", compression="gzip")
        made["csr-gzip.h5ad"] = "anndata"
        _adata("none").write_h5ad(root / "no-x.h5ad")
        made["no-x.h5ad"] = "anndata"
        nulls = _adata("csr")
        nulls.obs["batch"] = pd.array([1, None] * (CELLS // 2) + [3], dtype="Int64")
        nulls.obs["label"] = pd.array(["a", None] * (CELLS // 2) + ["c"], dtype="string")
        nulls.obs["flag"] = pd.array([True, None] * (CELLS // 2) + [False], dtype="boolean")
        nulls.obs["name"] = pd.array([f"n{i}" for i in range(CELLS)], dtype="string")
        nulls.obs["good"] = pd.array(np.arange(CELLS) % 2 == 0, dtype="boolean")
        with ad.settings.override(allow_write_nullable_strings=True):  # strings kept strings
            nulls.write_h5ad(root / "nullable.h5ad", convert_strings_to_categoricals=False)
        made["nullable.h5ad"] = "anndata"
        matrix = _adata("csr").X
        with h5py.File(root / "elements.h5", "w") as f:  # anndata's elements in a plain file
            ad.io.write_elem(f, "counts", matrix)
            ad.io.write_elem(f, "counts_csc", matrix.tocsc())
            ad.io.write_elem(f, "cell_type", _adata().obs["cell_type"].array)
            f["size_factor"] = np.arange(CELLS, dtype=np.float64)
            f["genes"] = np.arange(GENES * 2)  # longer than the cells: not their rows
        made["elements.h5"] = "anndata"
    _tenx(root / "tenx.h5", matrix)
    made["tenx.h5"] = "10x"
    _h5sparse(root / "h5sparse.h5", matrix)
    made["h5sparse.h5"] = "h5sparse"
    return {root / name: tool for name, tool in made.items()}


def _tenx(path, cells_by_genes):
    """10x Genomics' HDF5 layout: a CSC genes x barcodes ``matrix`` group."""
    genes_by_cells = cells_by_genes.T.tocsc()
    with h5py.File(path, "w") as f:
        g = f.create_group("matrix")
        g["data"] = genes_by_cells.data.astype(np.int32)
        g["indices"] = genes_by_cells.indices.astype(np.int64)
        g["indptr"] = genes_by_cells.indptr.astype(np.int64)
        g["shape"] = np.array(genes_by_cells.shape, np.int32)
        g["barcodes"] = np.array([f"AAAC{i:05d}-1".encode() for i in range(CELLS)])
        features = g.create_group("features")
        features["id"] = np.array([f"ENSG{i:05d}".encode() for i in range(GENES)])
        features["name"] = np.array([f"GENE{i}".encode() for i in range(GENES)])


def _h5sparse(path, matrix):
    """anndata < 0.7 and the h5sparse package: ``h5sparse_format`` / ``h5sparse_shape``."""
    with h5py.File(path, "w") as f:
        g = f.create_group("X")
        g.attrs["h5sparse_format"], g.attrs["h5sparse_shape"] = "csr", matrix.shape
        g["data"], g["indices"], g["indptr"] = matrix.data, matrix.indices, matrix.indptr


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_files(tmp_path_factory.mktemp("anndata"))


def _file(files, name):
    return next(p for p in files if p.name == name)


# -- reference readers ---------------------------------------------------------------------


def _dense(x):
    return x.toarray() if sp.issparse(x) else np.asarray(x)


def _anndata_reference(path):
    """{column: values} as anndata reads them, named as shareddata names them; labels."""
    a = ad.read_h5ad(path)
    out, labels = {}, {}
    if a.X is not None:
        out["X"] = _dense(a.X)
    out[f"obs/{a.obs.index.name or '_index'}"] = list(a.obs_names)
    for column in a.obs.columns:
        values = a.obs[column]
        if isinstance(values.dtype, pd.CategoricalDtype):
            out[f"obs/{column}"] = values.cat.codes.to_numpy()
            labels[f"obs/{column}"] = {c: i for i, c in enumerate(values.cat.categories)}
        elif values.isna().any():
            out[f"obs/{column}"] = "refused"  # <NA>: a column needs a value in every row
        elif isinstance(values.dtype, pd.StringDtype) or values.dtype == object:
            out[f"obs/{column}"] = list(values)
        elif isinstance(values.dtype, pd.api.extensions.ExtensionDtype):
            out[f"obs/{column}"] = values.to_numpy(values.dtype.numpy_dtype)
        else:
            out[f"obs/{column}"] = values.to_numpy()
    return out, labels


def _elements_reference(path):
    with h5py.File(path) as f:
        counts = ad.io.read_elem(f["counts"])
        out = {"counts": _dense(counts), "size_factor": f["size_factor"][()]}
        out["counts_csc"] = _dense(ad.io.read_elem(f["counts_csc"]))
        cell_type = ad.io.read_elem(f["cell_type"])
    out["cell_type"] = cell_type.codes
    return out, {"cell_type": {c: i for i, c in enumerate(cell_type.categories)}}


def _tenx_reference(path):
    with h5py.File(path) as f:
        g = f["matrix"]
        genes_by_cells = sp.csc_matrix((g["data"][()], g["indices"][()], g["indptr"][()]),
                                       shape=tuple(g["shape"][()]))  # fmt: skip
        barcodes = list(g["barcodes"][()])
    return {"matrix": genes_by_cells.T.toarray(), "matrix/barcodes": barcodes}, {}


def _h5sparse_reference(path):
    with h5py.File(path) as f:
        g = f["X"]
        matrix = sp.csr_matrix((g["data"][()], g["indices"][()], g["indptr"][()]),
                               shape=tuple(g.attrs["h5sparse_shape"]))  # fmt: skip
    return {"X": matrix.toarray()}, {}


REFERENCE = {
    "anndata": _anndata_reference,
    "10x": _tenx_reference,
    "h5sparse": _h5sparse_reference,
}


def _reference(path, tool):
    if path.name == "elements.h5":
        return _elements_reference(path)
    return REFERENCE[tool](path)


def _assert_values(got, want, where):
    if isinstance(got, torch.Tensor):
        got = got.to_dense() if got.layout == torch.sparse_coo else got
        want = np.asarray(want)
        assert tuple(got.shape) == want.shape, where
        np.testing.assert_array_equal(got.numpy(), want, err_msg=where)
        return
    assert len(got) == len(want), where
    for g, w in zip(got, want):
        w = bytes(w) if isinstance(w, np.bytes_) else str(w) if isinstance(w, np.str_) else w
        assert type(g) is type(w) and g == w, (where, g, w)


def compare(path, tool, sparse="dense"):
    """Rows of (file, column, what shareddata did, detail); asserts every value equal."""
    want, labels = _reference(path, tool)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the default selection warns about what it skips
        default = HDF5Dataset(path, progress=False, sparse=sparse)
    rows = []
    for column, reference in want.items():
        if isinstance(reference, str) and reference == "refused":
            assert column not in default.columns and column in _skipped(path)
            with pytest.raises(sd.NullValuesError, match=repr(column)):
                HDF5Dataset(path, [column], progress=False)
            rows.append((path.name, column, "refused", "NullValuesError: <NA> values"))
            continue
        assert column in default.columns, f"{path.name}: {column!r} not in the default selection"
        batch = default[list(range(len(default)))][column]
        _assert_values(batch, reference, f"{path.name}:{column}")
        assert default.labels.get(column) == labels.get(column), column
        rows.append((path.name, column, "equal", default.specs[column].describe()))
    extra = set(default.columns) - set(want)
    assert not extra, f"{path.name}: loaded beyond the reference: {sorted(extra)}"
    return rows


def _skipped(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with HDF5Source(path) as source:
            return source.skipped


# -- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("sparse", ["dense", "coo"])
def test_every_cell_equals_anndata_or_is_refused_by_name(files, sparse):
    table = []
    for path, tool in files.items():
        table += compare(path, tool, sparse)
    assert {name for name, *_ in table} == {p.name for p in files}


def test_an_h5ad_is_its_cells_not_its_nonzeros(files):
    path = _file(files, "csr.h5ad")
    ds = HDF5Dataset(path, progress=False)
    assert len(ds) == CELLS  # not the nonzeros of X/data
    assert ds.columns == ["X", "obs/barcode", "obs/cell_type", "obs/n_genes", "obs/pct_mito",
                          "obs/is_doublet", "obs/donor", "obs/batch"]  # fmt: skip
    assert ds.specs["X"].kind == "sparse" and ds.specs["X"].shape == (GENES,)
    a = ad.read_h5ad(path)
    # the matrix stays compressed in shared memory: indptr + indices + data
    assert ds.specs["X"].nbytes == (CELLS + 1) * 8 + a.X.nnz * (4 + 4)
    sample = ds[5]
    np.testing.assert_array_equal(sample["X"].numpy(), a.X[5].toarray()[0])
    assert sample["obs/barcode"] == a.obs_names[5]
    labels = {code: label for label, code in ds.labels["obs/cell_type"].items()}
    codes = ds[list(range(CELLS))]["obs/cell_type"].tolist()
    assert [labels.get(c) for c in codes] == [
        None if pd.isna(v) else v for v in a.obs["cell_type"]
    ]  # -1 is a missing category, as pandas' codes
    coo = HDF5Dataset(path, ["X"], sparse="coo", progress=False)[7]["X"]
    assert coo.layout == torch.sparse_coo and coo.shape == (GENES,)
    np.testing.assert_array_equal(coo.to_dense().numpy(), a.X[7].toarray()[0])


def test_obsm_layers_and_obsp_load_when_named(files):
    path = _file(files, "csc.h5ad")
    a = ad.read_h5ad(path)
    ds = HDF5Dataset(path, ["X", "obsm", "layers/counts", "obsp/distances"], progress=False)
    assert ds.columns == ["X", "obsm/X_pca", "obsm/X_umap", "layers/counts", "obsp/distances"]
    batch = ds[list(range(CELLS))]
    np.testing.assert_array_equal(batch["X"].numpy(), a.X.toarray())
    np.testing.assert_array_equal(batch["obsm/X_pca"].numpy(), a.obsm["X_pca"])
    np.testing.assert_array_equal(batch["layers/counts"].numpy(), a.layers["counts"].toarray())
    np.testing.assert_array_equal(batch["obsp/distances"].numpy(), a.obsp["distances"].toarray())
    with pytest.raises(KeyError, match="'nope' is not a dataset"):
        HDF5Dataset(path, ["nope"])


@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("sparse", ["dense", "coo"])
def test_cells_in_dataloader_workers(files, method, sparse):
    path = _file(files, "csc.h5ad")
    a = ad.read_h5ad(path)
    ds = HDF5Dataset(path, ["X", "obs/cell_type", "obs/barcode"], sparse=sparse, progress=False)
    loader = DataLoader(ds, batch_size=32, num_workers=2, multiprocessing_context=method,
                        timeout=60)  # fmt: skip
    batches = list(loader)
    x = torch.cat([b["X"].to_dense() if sparse == "coo" else b["X"] for b in batches])
    np.testing.assert_array_equal(x.numpy(), a.X.toarray())
    if sparse == "coo":
        assert all(b["X"].layout == torch.sparse_coo for b in batches)
        assert batches[0]["X"].shape == (32, GENES)
    codes = torch.cat([b["obs/cell_type"] for b in batches]).numpy()
    np.testing.assert_array_equal(codes, a.obs["cell_type"].cat.codes.to_numpy())
    assert [n for b in batches for n in b["obs/barcode"]] == list(a.obs_names)


def _identity(batch):
    return batch


@pytest.mark.parametrize("sparse", ["dense", "coo"])
def test_a_batch_of_sparse_rows_leaves_a_worker_as_one_memfd(files, monkeypatch, sparse):
    from torch.multiprocessing import reductions

    from shareddata.crossing import _transport

    calls = []
    for module, name in [(reductions, "rebuild_storage_fd"), (_transport, "receive")]:
        original = getattr(module, name)

        def counted(*args, _name=name, _original=original):
            calls.append(_name)
            return _original(*args)

        counted.__name__ = counted.__qualname__ = name
        counted.__module__ = module.__name__
        monkeypatch.setattr(module, name, counted)
    path = _file(files, "csr.h5ad")
    ds = HDF5Dataset(path, ["X"], sparse=sparse, progress=False)
    want = ad.read_h5ad(path).X.toarray()
    for collate in (None, _identity):
        calls.clear()
        loader = DataLoader(ds, batch_size=50, num_workers=1, collate_fn=collate,
                            multiprocessing_context="spawn", timeout=60)  # fmt: skip
        rows = []
        for batch in loader:
            xs = [s["X"] for s in batch] if collate else list(batch["X"].unbind(0))
            rows += [x.to_dense() if sparse == "coo" else x for x in xs]
        np.testing.assert_array_equal(torch.stack(rows).numpy(), want)
        assert calls == ["receive"] * 5, (collate, calls)  # one memfd per batch, no torch's


def test_a_node_shard_of_a_sparse_matrix(files):
    for name in ("csr.h5ad", "csc.h5ad"):
        path = _file(files, name)
        want = ad.read_h5ad(path).X.toarray()[50:120]
        with HDF5Source(path, ["X"]) as source:
            source.select_rows(50, 120)
            columns = build(source, share="process", progress=False)
        got = columns["X"].gather(torch.arange(70))
        np.testing.assert_array_equal(got.numpy(), want)


def test_sparse_groups_outside_anndata_are_rows(files):
    ds = HDF5Dataset(_file(files, "tenx.h5"), progress=False)
    assert ds.columns == ["matrix", "matrix/barcodes"] and len(ds) == CELLS
    elements = HDF5Dataset(_file(files, "elements.h5"), progress=False)
    assert len(elements) == CELLS and "genes" not in elements.columns
    assert elements.labels["cell_type"] == {"B": 0, "Mono": 1, "NK": 2, "T": 3}


def test_a_corrupt_sparse_group_is_named(tmp_path):
    path = tmp_path / "bad.h5"
    matrix = sp.random(10, 5, density=0.3, format="csr", random_state=0)
    with h5py.File(path, "w") as f:
        ad.io.write_elem(f, "m", matrix)
        del f["m/indptr"]
        f["m/indptr"] = matrix.indptr[:-2]
    with pytest.raises(sd.SourceReadError, match=r"group 'm' is marked as a CSR.*'indptr'"):
        HDF5Dataset(path, ["m"])
    with h5py.File(path, "a") as f:
        del f["m/indptr"]
        f["m/indptr"] = matrix.indptr
        f["m/indices"][0] = 99
    with pytest.raises(sd.SourceReadError, match=r"column index outside \[0, 5\)"):
        HDF5Dataset(path, ["m"], progress=False)
    with pytest.raises(ValueError, match="sparse='csr' is not one of"):
        HDF5Dataset(path, sparse="csr")


@pytest.mark.parametrize("keep", [0.3, 0.6, 0.9])
def test_a_truncated_h5ad_is_a_named_error(files, tmp_path, keep):
    data = _file(files, "csc.h5ad").read_bytes()
    cut = tmp_path / "cut.h5ad"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(sd.SharedDataError, match="cut.h5ad"):
        HDF5Dataset(cut, progress=False)


if __name__ == "__main__":  # the table for the docs / a report
    import tempfile
    from pathlib import Path

    made = make_files(Path(tempfile.mkdtemp(prefix="anndata")))
    print("| file | column | result | kind / error |\n|---|---|---|---|")
    for file, tool in made.items():
        for row in compare(file, tool):
            print("| " + " | ".join(row) + " |")
    sys.exit(0)


def test_obs_without_anndata_is_a_named_error_and_x_still_loads(files, monkeypatch):
    """obs is read by anndata's own reader; without anndata the error names the extra."""
    path = _file(files, "csr.h5ad")
    monkeypatch.setitem(sys.modules, "anndata", None)  # import anndata: ImportError
    with pytest.raises(sd.MissingDependencyError, match=r"torch-shareddata\[anndata\]"):
        HDF5Dataset(path, progress=False)
    x = HDF5Dataset(path, ["X"], progress=False)  # the matrix needs no anndata
    assert x.specs["X"].kind == "sparse" and len(x) == CELLS
