"""Mutated files for the file readers, and a worker that loads them one after another.

``case(fmt, seed, i, directory)`` writes the ``i``-th mutated file of a format
(``npy``, ``hdf5``, ``parquet``): a valid base file (one of a few, made from fixed
seeds) with one mutation: for ``.npy`` an edited header (a byte, the shape, the
dtype, the order flag, the length field, the magic, a truncation); for HDF5 and
Parquet a truncation, bit flips, or an overwritten run of bytes (biased towards the
metadata: HDF5's superblock and object headers at the start, Parquet's footer).

Run as ``python fuzzworker.py FMT SEED FIRST LAST DIR``: for every case it prints
``@@START i`` before and ``@@DONE i {json}`` after, so that the parent can tell
which case crashed or hung (and restart after it). The outcome is one of:

* ``equal``: loaded, and equal to what the format's own library reads;
* ``named``: a ``SharedDataError`` whose message names the file;
* bad ones: ``unnamed`` (a SharedDataError not naming the file), ``foreign`` (an
  exception that is not a SharedDataError), ``differs`` (loaded, but not what the
  reference reads), ``leak`` (descriptors or mappings left after the case).
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
import traceback

import numpy as np

FORMATS = ("npy", "npz", "hdf5", "parquet")
_NPY_DTYPES = ["<f4", ">f8", "|u1", "<i2", ">u4", "|b1", "<c8", "<f2", "<i8"]
_BAD_DESCR = ["|O", "<U3", "|S4", "|V8", "<M8[s]", "garbage", "<i0", "", "[('a', '<i4')]", "<f3"]


# -- base files --------------------------------------------------------------------------


def _npy_bases() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    out = []
    for k, dt in enumerate(_NPY_DTYPES):
        shape = [(16,), (8, 3), (4, 2, 3), (0, 5), (5, 0)][k % 5]
        a = (rng.random(shape) * 100).astype(dt)
        out.append(np.asfortranarray(a) if k % 3 == 0 and a.ndim > 1 else a)
    return out


def _write_npy(path: str, array: np.ndarray, version: tuple[int, int]) -> None:
    with open(path, "wb") as f:
        np.lib.format.write_array(f, array, version=version, allow_pickle=False)


def _write_hdf5(path: str, k: int) -> None:
    import h5py

    rng = np.random.default_rng(k)
    rows = 64
    with h5py.File(path, "w") as f:
        f["x"] = rng.random((rows, 3), np.float32)
        f.create_dataset("y", data=np.arange(rows, dtype=">i8"), chunks=(8,), compression="gzip")
        f["g/name"] = np.array([f"r{i}é" * (i % 4) for i in range(rows)], dtype=h5py.string_dtype())
        if k % 2:
            f.create_dataset(
                "g/z",
                data=rng.integers(0, 9, (rows, 2), np.int16),
                chunks=(16, 2),
                shuffle=True,
                fletcher32=True,
            )
            f["fixed"] = np.array([b"ab" * (i % 3) for i in range(rows)], dtype="S6")
        f.attrs["note"] = "fuzz base"


def _write_parquet(path: str, k: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(k)
    rows = 96
    table = pa.table(
        {
            "i": pa.array(rng.integers(-1000, 1000, rows)),
            "f": pa.array(rng.random(rows).astype(np.float32)),
            "s": pa.array([f"s{i}ü" * (i % 3) for i in range(rows)]),
            "b": pa.array([bytes([i % 256]) * (i % 4) for i in range(rows)], pa.binary()),
            "l": pa.array([list(range(i % 5)) for i in range(rows)], pa.list_(pa.int32())),
            "v": pa.array([[float(i), -float(i)] for i in range(rows)], pa.list_(pa.float64(), 2)),
        }
    )
    pq.write_table(
        table,
        path,
        row_group_size=32,
        compression=["none", "snappy", "gzip", "zstd"][k % 4],
        use_dictionary=bool(k % 2),
        data_page_size=256 if k % 3 == 0 else None,
    )


# -- mutations ---------------------------------------------------------------------------


def _mutate_npy(rng: random.Random, tmp: str) -> tuple[bytes, str]:
    bases = _npy_bases()
    array = bases[rng.randrange(len(bases))]
    version = rng.choice([(1, 0), (2, 0)])
    _write_npy(tmp, array, version)
    with open(tmp, "rb") as f:
        data = bytearray(f.read())
    hlen_size = 2 if version == (1, 0) else 4
    start = 8 + hlen_size
    hlen = int.from_bytes(data[8:start], "little")
    header = data[start : start + hlen].decode("latin1")
    kind = rng.choice(["byte", "shape", "descr", "order", "length", "magic", "truncate", "edit"])
    if kind == "byte":
        data[rng.randrange(start + hlen)] = rng.randrange(256)
    elif kind in ("shape", "descr", "order", "edit"):
        if kind == "shape":
            dims = rng.randrange(0, 4)
            values = [
                rng.choice([0, 1, 3, 16, -1, 2**31, 2**40, 2**62, 2**64, rng.randrange(100)])
                for _ in range(dims)
            ]
            new_shape = "(" + ", ".join(map(str, values)) + ("," if dims == 1 else "") + ")"
            if rng.random() < 0.2:
                new_shape = rng.choice(["(1.5,)", "('a',)", "[3]", "(3", "None", "(-0,)"])
            a, b = header.index("'shape': ") + 9, header.index(")", header.index("'shape'")) + 1
            header = header[:a] + new_shape + header[b:]
        elif kind == "descr":
            a = header.index("'descr': ") + 9
            b = header.index(",", a)
            header = header[:a] + repr(rng.choice(_BAD_DESCR + _NPY_DTYPES)) + header[b:]
        elif kind == "order":
            value = rng.choice(["True", "False", "1", "'yes'", "None"])
            header = header.replace("False", value).replace("True", value)
        else:  # insert or delete a few characters anywhere in the dict
            pos = rng.randrange(len(header))
            if rng.random() < 0.5:
                header = header[:pos] + header[pos + rng.randrange(1, 4) :]
            else:
                header = (
                    header[:pos]
                    + rng.choice(["{", "}", "'", ",", ":", " ", "\n", "x"])
                    + header[pos:]
                )
        encoded = header.encode("latin1")
        data[8:start] = len(encoded).to_bytes(hlen_size, "little")
        data[start : start + hlen] = encoded
    elif kind == "length":
        data[8:start] = rng.randrange(0, 1 << (8 * hlen_size)).to_bytes(hlen_size, "little")
    elif kind == "magic":
        data[rng.randrange(8)] = rng.randrange(256)
    else:
        del data[rng.randrange(len(data) + 1) :]
    return bytes(data), kind


def _mutate_binary(rng: random.Random, data: bytearray, meta: range) -> str:
    kind = rng.choice(["truncate", "flip", "flip-meta", "overwrite", "overwrite-meta"])
    if kind == "truncate":
        del data[rng.randrange(len(data)) :]
    elif kind.startswith("flip"):
        where = meta if kind.endswith("meta") else range(len(data))
        for _ in range(rng.randrange(1, 9)):
            pos = rng.choice(where)
            data[pos] ^= 1 << rng.randrange(8)
    else:
        where = meta if kind.endswith("meta") else range(len(data))
        pos = rng.choice(where)
        n = rng.randrange(4, 17)
        data[pos : pos + n] = bytes(rng.randrange(256) for _ in range(n))
    return kind


def case(fmt: str, seed: int, i: int, directory: str) -> tuple[str, str]:
    """Write mutated file ``i`` of ``fmt``; return its path and the mutation's kind."""
    rng = random.Random(f"{fmt}-{seed}-{i}")
    ext = {"npy": ".npy", "npz": ".npz", "hdf5": ".h5", "parquet": ".parquet"}[fmt]
    path = os.path.join(directory, f"case{i}{ext}")
    if fmt == "npy":
        data, kind = _mutate_npy(rng, path)
    elif fmt == "npz":  # the mutated .npy as a member of an archive, stored or deflated
        import io
        import zipfile

        member, kind = _mutate_npy(rng, path)
        buffer = io.BytesIO()
        method = rng.choice([zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
        with zipfile.ZipFile(buffer, "w", method) as z:
            z.writestr("m.npy", member)
        data = buffer.getvalue()
    else:
        k = rng.randrange(4)
        base = os.path.join(directory, f"base{k}{ext}")
        if not os.path.exists(base):
            (_write_hdf5 if fmt == "hdf5" else _write_parquet)(base, k)
        with open(base, "rb") as f:
            raw = bytearray(f.read())
        if fmt == "hdf5":
            meta = range(min(len(raw), 2048))  # superblock, root group, object headers
        else:
            meta = range(max(0, len(raw) - 1024), len(raw))  # footer: thrift metadata
        kind = _mutate_binary(rng, raw, meta)
        data = bytes(raw)
    with open(path, "wb") as f:
        f.write(data)
    return path, kind


# -- loading one case --------------------------------------------------------------------


def _ours_state() -> tuple[int, int]:
    gc.collect()
    with open("/proc/self/maps") as f:
        maps = sum("memfd:shareddata" in line for line in f)
    return len(os.listdir("/proc/self/fd")), maps


def _equal(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        a = a.numpy()
    if isinstance(b, (np.ndarray, np.generic)) or isinstance(a, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
    if isinstance(b, float) and isinstance(a, float):
        return a == b or (a != a and b != b)
    return a == b


def _picks(rows: int) -> list[int]:
    """The rows compared: all of them, or the first and last 1000 of a long file.

    A mutated header can declare billions of empty rows (shape ``(2**31, 0)``): both
    readers load it at once, but comparing row by row would take hours.
    """
    return list(range(rows)) if rows <= 2000 else [*range(1000), *range(rows - 1000, rows)]


def _reference_rows(fmt: str, path: str, columns: list[str], picks: list[int]) -> list[dict]:
    """What the format's own library reads at rows ``picks``, as our samples look."""
    if fmt in ("npy", "npz"):
        loaded = np.load(path, allow_pickle=False)
        arrays = {columns[0]: loaded} if fmt == "npy" else {n: loaded[n] for n in columns}
        if len(next(iter(arrays.values()))) != (picks[-1] + 1 if picks else 0):
            return []  # a different length: differs
        return [
            {n: a[i].astype(a.dtype.newbyteorder("=")) for n, a in arrays.items()} for i in picks
        ]
    if fmt == "hdf5":
        import h5py

        with h5py.File(path, "r") as f:
            data = {}
            for name in columns:
                ds = f[name]
                values = ds[()]
                if h5py.check_string_dtype(ds.dtype) is not None:
                    enc = h5py.check_string_dtype(ds.dtype)
                    if enc.length is None or enc.encoding == "utf-8":
                        values = [v.decode("utf-8") if isinstance(v, bytes) else v for v in values]
                        if enc.length is not None:
                            values = [v.rstrip("\0") for v in values]
                    else:
                        values = [bytes(v).rstrip(b"\0") for v in values]
                else:
                    values = values.astype(values.dtype.newbyteorder("="))
                data[name] = values
        if len(next(iter(data.values()))) != (picks[-1] + 1 if picks else 0):
            return []
        return [{n: data[n][i] for n in columns} for i in picks]
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=columns)
    if table.num_rows != (picks[-1] + 1 if picks else 0):
        return []
    return table.take(picks).to_pylist()


def _sample_value(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value.tolist() if value.ndim else value.item()
    return value


def run_case(fmt: str, path: str) -> dict:
    import shareddata as sd
    from shareddata import ParquetDataset

    loaders = {
        "npy": sd.NumpyDataset,
        "npz": sd.NumpyDataset,
        "hdf5": sd.HDF5Dataset,
        "parquet": ParquetDataset,
    }
    before = _ours_state()
    out: dict = {}
    try:
        ds = loaders[fmt](path, progress=False)
        picks = _picks(len(ds))
        samples = [ds[i] for i in picks]
        columns = ds.columns
        del ds
    except sd.SharedDataError as e:
        named = os.path.basename(path) in str(e)
        out = {"outcome": "named" if named else "unnamed", "error": f"{type(e).__name__}: {e}"}
    except Exception as e:  # noqa: BLE001
        out = {
            "outcome": "foreign",
            "error": f"{type(e).__name__}: {e}",
            "where": traceback.format_exc(limit=-3),
        }
    else:
        try:
            reference = _reference_rows(fmt, path, columns, picks)
        except Exception as e:  # noqa: BLE001
            out = {"outcome": "differs", "error": f"reference failed: {type(e).__name__}: {e}"}
        else:
            same = len(reference) == len(samples)
            for ours, ref in zip(samples, reference):
                for name in columns:
                    a = ours[name]
                    b = ref[name]
                    if fmt == "parquet":
                        a = _sample_value(a)
                    if not _equal(a, b):
                        same = False
            out = {"outcome": "equal" if same else "differs", "rows": len(samples)}
        del samples
    after = _ours_state()
    if after != before:
        out = {**out, "outcome": "leak", "fds_maps": [before, after]}
    return out


def reference_only(fmt: str, path: str) -> None:
    """Read ``path`` with the format's own library alone (no shareddata): for triage."""
    if fmt in ("npy", "npz"):
        loaded = np.load(path, allow_pickle=False)
        if fmt == "npz":
            [loaded[n] for n in loaded.files]
    elif fmt == "hdf5":
        import h5py

        with h5py.File(path, "r") as f:
            names = []
            f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
            for n in names:
                f[n][()]
    else:
        import pyarrow.parquet as pq

        pq.read_table(path)


def main() -> None:
    if sys.argv[1] == "--reference":
        try:
            reference_only(sys.argv[2], sys.argv[3])
        except Exception as e:  # noqa: BLE001  an exception is fine: we look for crashes
            print(f"raised {type(e).__name__}")
        return
    fmt, seed, first, last, directory = sys.argv[1:6]
    for i in range(int(first), int(last)):
        print(f"@@START {i}", flush=True)
        path, kind = case(fmt, int(seed), i, directory)
        result = run_case(fmt, path)
        result["kind"] = kind
        os.unlink(path)
        print(f"@@DONE {i} {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    main()
