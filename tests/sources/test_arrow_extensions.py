"""Arrow extension types load as what they mean, or are refused by name; never as storage.

Values are compared with pyarrow's own ``to_pylist()`` (``uuid.UUID``, bool, JSON text),
and HF ``datasets`` arrays with ``datasets``' own torch format.
"""

import json
import os
import sys
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

import shareddata as sd

sys.path.insert(0, os.path.dirname(__file__))
from test_arrow import plain, rows_of  # noqa: E402

IDS = [uuid.UUID(int=0), uuid.uuid4(), uuid.UUID("12345678-1234-5678-1234-567812345678")]


def _uuids(values=IDS):
    return pa.array([None if v is None else v.bytes for v in values], pa.uuid())


def _bool8(values):
    return pa.ExtensionArray.from_storage(pa.bool8(), pa.array(values, pa.int8()))


def _both(table, tmp_path, **kwargs):
    """The table loaded by ArrowDataset and, written by pyarrow, by ParquetDataset."""
    path = tmp_path / "ext.parquet"
    pq.write_table(table, path, row_group_size=2)
    return [sd.ArrowDataset(table, progress=False, **kwargs),
            sd.ParquetDataset(path, progress=False, **kwargs)]  # fmt: skip


def test_uuid_bool8_and_json_load_as_what_to_pylist_gives(tmp_path):
    table = pa.table({
        "id": _uuids(),
        "flag": _bool8([1, 0, 7]),  # any non-zero byte is True
        "doc": pa.array(['{"a": 1}', "[]", "null"], pa.json_()),
        "meta": pa.StructArray.from_arrays([_uuids(), pa.array([1, 2, 3])], ["ref", "n"]),
    })  # fmt: skip
    for ds in _both(table, tmp_path):
        assert ds.columns == ["id", "flag", "doc", "meta.ref", "meta.n"]
        assert ds.specs["id"].kind == "uuid" and ds.specs["flag"].dtype == np.bool_
        want = [{k: r[k.split(".")[0]][k.split(".")[1]] if "." in k else r[k]
                 for k in ds.columns} for r in table.to_pylist()]  # fmt: skip
        assert rows_of(ds) == want
        assert isinstance(ds[1]["id"], uuid.UUID) and ds[2]["id"] == IDS[2]
        assert ds[[2, 0]]["id"] == [IDS[2], IDS[0]]  # a batch's UUIDs: their list
        batch = next(iter(DataLoader(ds, batch_size=3)))  # the default collate takes them
        assert batch["id"] == IDS and batch["flag"].tolist() == [True, False, True]


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_uuids_reach_workers_as_uuids_or_tensors(method):
    table = pa.table({"id": _uuids(), "x": [1, 2, 3]})
    ds = sd.ArrowDataset(table, progress=False)
    loader = DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context=method,
                        timeout=120)  # fmt: skip
    assert [u for b in loader for u in b["id"]] == IDS
    raw = sd.ArrowDataset(table, uuid_as="tensor", progress=False)
    assert raw.specs["id"].kind == "tensor" and raw.specs["id"].shape == (16,)
    loader = DataLoader(raw, batch_size=3, num_workers=1, multiprocessing_context=method,
                        timeout=120)  # fmt: skip
    (batch,) = list(loader)
    assert batch["id"].dtype == torch.uint8 and batch["id"].shape == (3, 16)
    assert [uuid.UUID(bytes=bytes(r)) for r in batch["id"].tolist()] == IDS


def test_null_uuids_are_refused_or_filled_with_the_nil_uuid():
    table = pa.table({"id": _uuids([IDS[1], None])})
    with pytest.raises(sd.NullValuesError, match="'id'.*1 null"):
        sd.ArrowDataset(table, progress=False)
    ds = sd.ArrowDataset(table, fill_value=0, progress=False)
    assert [ds[0]["id"], ds[1]["id"]] == [IDS[1], uuid.UUID(int=0)]


def test_uuid_as_is_checked():
    with pytest.raises(sd.errors.InvalidArgumentError, match="uuid_as='bytes'.*'uuid'.*'tensor'"):
        sd.ArrowDataset(pa.table({"id": _uuids()}), uuid_as="bytes", progress=False)


def test_unknown_extensions_are_refused_by_name_registered_or_not(tmp_path):
    opaque = pa.ExtensionArray.from_storage(
        pa.opaque(pa.binary(), "geometry", "postgis"), pa.array([b"\x01", b"\x02"])
    )
    # an extension this process has no class for: its name is in the field's metadata
    wkb = pa.field("geom", pa.binary(), metadata={b"ARROW:extension:name": b"geoarrow.wkb",
                                                  b"ARROW:extension:metadata": b"{}"})  # fmt: skip
    tables = {
        "arrow.opaque": pa.table({"ok": [1, 2], "bad": opaque}),
        "geoarrow.wkb": pa.Table.from_arrays([pa.array([1, 2]), pa.array([b"\x01", b"\x02"])],
                                             schema=pa.schema([("ok", pa.int64()), wkb])),
    }  # fmt: skip
    for name, table in tables.items():
        bad = table.column_names[1]
        with pytest.raises(sd.UnsupportedDtypeError, match=rf"'{bad}'.*{name}.*storage") as e:
            sd.ArrowDataset(table, progress=False)
        assert isinstance(e.value, TypeError) and "silently" in str(e.value)
        assert sd.ArrowDataset(table, columns=["ok"], progress=False)[1] == {"ok": torch.tensor(2)}


def test_extensions_inside_lists_are_refused_by_name():
    table = pa.table({"ids": pa.ListArray.from_arrays([0, 2, 3], _uuids())})
    with pytest.raises(sd.UnsupportedDtypeError, match="'ids'.*arrow.uuid"):
        sd.ArrowDataset(table, progress=False)
    docs = pa.table({"docs": pa.ListArray.from_arrays([0, 1, 1], pa.array(["{}"], pa.json_()))})
    assert rows_of(sd.ArrowDataset(docs, progress=False)) == [{"docs": ["{}"]}, {"docs": []}]


def _hf_field(name, shape, dtype, storage):
    params = json.dumps([list(shape), dtype]).encode()
    kind = f"datasets.features.features.Array{len(shape)}DExtensionType".encode()
    return pa.field(name, storage, metadata={b"ARROW:extension:name": kind,
                                             b"ARROW:extension:metadata": params})  # fmt: skip


def test_hf_arrays_load_as_tensors_of_their_shape_registered_or_not():
    images = np.arange(3 * 2 * 3, dtype=np.float32).reshape(3, 2, 3)
    ragged = [np.ones((1, 2)), np.zeros((0, 2)), np.full((3, 2), 2.0)]
    image_type = pa.list_(pa.list_(pa.float32()))
    rows_type = pa.list_(pa.list_(pa.float64()))
    # as HF writes them, read where datasets is not imported: storage + field metadata
    table = pa.Table.from_arrays(
        [pa.array([i.tolist() for i in images], image_type),
         pa.array([r.tolist() for r in ragged], rows_type)],
        schema=pa.schema([_hf_field("image", (2, 3), "float32", image_type),
                          _hf_field("rows", (None, 2), "float64", rows_type)]),
    )  # fmt: skip
    ds = sd.ArrowDataset(table, progress=False)
    assert ds.specs["image"].shape == (2, 3) and ds.specs["image"].dtype == np.float32
    np.testing.assert_array_equal(ds[2]["image"].numpy(), images[2])
    assert torch.equal(ds[[0, 1]]["image"], torch.from_numpy(images[:2]))
    # a first dimension of None: the row's sub-arrays, as its nested lists hold them
    assert [plain(ds[i]["rows"]) for i in range(3)] == [r.tolist() for r in ragged]

    datasets = pytest.importorskip("datasets")  # the same data with the classes registered
    hf = datasets.Dataset.from_dict(
        {"image": images, "rows": ragged},
        features=datasets.Features({"image": datasets.Array2D((2, 3), "float32"),
                                    "rows": datasets.Array2D((None, 2), "float64")}),
    )  # fmt: skip
    assert isinstance(hf.data.table.schema.field("image").type, pa.ExtensionType)
    loaded = sd.ArrowDataset(hf, progress=False)
    want = hf.with_format("torch")
    for i in range(3):
        assert torch.equal(loaded[i]["image"], want[i]["image"])
        assert plain(loaded[i]["rows"]) == want[i]["rows"].tolist()


def test_hf_array_rows_of_another_shape_are_named():
    storage = pa.list_(pa.list_(pa.int32()))
    table = pa.Table.from_arrays(
        [pa.array([[[1, 2], [3, 4]], [[1, 2, 3], [4, 5, 6]]], storage)],
        schema=pa.schema([_hf_field("a", (2, 2), "int32", storage)]),
    )
    with pytest.raises(sd.SourceReadError, match=r"'a'.*3 values at dimension 1.*\(2, 2\)"):
        sd.ArrowDataset(table, progress=False)
