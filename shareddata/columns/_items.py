"""What an item of a wrapped dataset is: its schema, its leaves, and the per-item fast path.

Each item is split into *leaves* along a schema inferred from the first item (a tree
of tuples, lists and dicts); each leaf becomes one column (``_materialise/``).

Note [The per-item fast path]
=============================
Materialising must cost little more than iterating the dataset once, so the work
per item is one call to a function generated for the schema (as ``dataclasses``
generates ``__init__``): for an ``(image, label, caption)`` tuple it tests
``type(item) is tuple and len(item) == 3``, then each leaf's exact type, dtype and
(fixed) shape, and appends the three values to per-column lists; ~0.5 us in all,
where walking the schema tree took several. It accepts only what surely matches
the columns as they stand and appends nothing otherwise: the item then takes the
checked path (``Builder._add_checked`` in ``_materialise/_builder.py``), which
names the index and the field of any difference, or adapts a column (a shape that
varies makes the column ragged; a list of numbers that stops being one makes it
pickled) and recompiles the fast path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any

import numpy as np
import torch

from ..errors import (
    InvalidArgumentError,
    ItemMismatchError,
)
from ..storage import to_numpy_dtype

__all__ = [
    "FIXED",
    "INT64_MAX",
    "INT64_MIN",
    "Leaf",
    "check_leaf",
    "classify",
    "compile_fast_path",
    "describe_leaf",
    "describe_value",
    "field_name",
    "flatten",
    "host_numpy",
    "infer_schema",
    "nest_paths",
    "numeric_list",
    "plain_tensor",
    "rebuild",
    "unnest",
]


# -- leaves ------------------------------------------------------------------------------
# A leaf is one column. ``kind`` says how a value is stored and rebuilt:
#   tensor / ndarray / npscalar / int / float / bool : fixed rows (TensorColumn);
#   when the shape of tensors/arrays varies they switch to ragged values + shapes;
#   str / bytes : StringColumn / BytesColumn; intlist / floatlist : RaggedColumn;
#   pickle : BytesColumn of pickled objects.

FIXED = {"tensor", "ndarray", "npscalar", "int", "float", "bool"}
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass
class Leaf:
    """One leaf of the schema: how its values are stored (``dtype``: the column's).

    ``tensor_type`` is a tensor leaf's class when it is not ``torch.Tensor`` (an
    ``nn.Parameter``, a subclass), ``requires_grad`` its flag, ``array_dtype`` an
    ndarray leaf's own dtype when its byte order is not native (``>i4``): the
    column holds native values, given back in that order (Note [What comes back]
    in ``_restore.py``).
    """

    path: str
    kind: str
    dtype: np.dtype
    shape: tuple[int, ...] = ()
    ragged: bool = False
    torch_dtype: torch.dtype | None = None
    tensor_type: type | None = None
    requires_grad: bool = False
    array_dtype: np.dtype | None = None


def field_name(path: str) -> str:
    return repr(path) if path else "the item itself"


def describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        name = "tensor" if type(value) is torch.Tensor else type(value).__name__
        grad = " requiring grad" if value.requires_grad else ""
        extra = " with attributes" if type(value) is not torch.Tensor and value.__dict__ else ""
        return f"{name} {value.dtype} {tuple(value.shape)}{grad}{extra}"
    if isinstance(value, np.ndarray):
        dtype = value.dtype if value.dtype.isnative else value.dtype.str  # ">i4"
        return f"ndarray {dtype} {value.shape}"
    return type(value).__name__


def describe_leaf(leaf: Leaf) -> str:
    """What a leaf's values are, as :func:`describe_value` says it of a value (no shape)."""
    if leaf.kind == "tensor":
        name = "tensor" if leaf.tensor_type is None else leaf.tensor_type.__name__
        dtype = str(leaf.torch_dtype)[len("torch.") :]
        return f"{name} {dtype}" + (" requiring grad" if leaf.requires_grad else "")
    if leaf.kind == "ndarray" and leaf.array_dtype is not None:
        return f"ndarray {leaf.array_dtype.str}"
    return f"{leaf.kind} {leaf.dtype}" if leaf.kind in FIXED - {"int"} else leaf.kind


def _rebuildable(value: torch.Tensor) -> bool:
    """Whether a tensor of a subclass comes back as itself from its data (``as_subclass``).

    Not a wrapper subclass (its own ``__torch_dispatch__``: its data is not its
    storage) and no attributes of its own (``as_subclass`` would not carry them).
    """
    cls = type(value)
    dispatch = getattr(cls, "__torch_dispatch__", None)
    return dispatch is torch.Tensor.__torch_dispatch__ and not value.__dict__


_STORED_AS = {torch.bfloat16: torch.int16}
"""Tensor dtypes numpy lacks, and the dtype of the same size their bits are stored as."""


def host_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's values as a numpy array on the host (a bfloat16 one's bits as int16)."""
    tensor = tensor.detach().cpu()
    stored = _STORED_AS.get(tensor.dtype)
    return (tensor if stored is None else tensor.view(stored)).numpy()


_PICKLED = "USVMm"
"""numpy kinds a tensor cannot hold (strings, records, datetimes): such values are pickled."""


def classify(value: Any, path: str) -> Leaf | None:
    """The leaf for ``value``, or None when it is a structure (tuple, list, dict)."""
    if isinstance(value, torch.Tensor):
        if value.layout is not torch.strided or value.is_quantized or value.is_nested:
            return Leaf(path, "pickle", np.dtype(np.uint8))  # sparse, quantized: kept whole
        cls = type(value)
        if cls is not torch.Tensor and not _rebuildable(value):
            return Leaf(path, "pickle", np.dtype(np.uint8))  # kept whole: pickle keeps all
        dtype = to_numpy_dtype(_STORED_AS.get(value.dtype, value.dtype))
        return Leaf(
            path, "tensor", dtype, tuple(value.shape), torch_dtype=value.dtype,
            tensor_type=None if cls is torch.Tensor else cls, requires_grad=value.requires_grad,
        )  # fmt: skip
    if isinstance(value, np.ndarray):  # np.memmap too: given back as an ndarray
        dtype = value.dtype
        if dtype.hasobject or dtype.fields is not None or dtype.kind in _PICKLED:
            return Leaf(path, "pickle", np.dtype(np.uint8))
        own = None if dtype.isnative else dtype
        return Leaf(path, "ndarray", dtype.newbyteorder("="), value.shape, array_dtype=own)
    if isinstance(value, np.generic) and value.dtype.kind not in _PICKLED:
        return Leaf(path, "npscalar", value.dtype.newbyteorder("="))
    if isinstance(value, bool):
        return Leaf(path, "bool", np.dtype(np.bool_))
    if isinstance(value, int):
        return Leaf(path, "int", np.dtype(np.int64))
    if isinstance(value, float):
        return Leaf(path, "float", np.dtype(np.float64))
    if type(value) is str:
        return Leaf(path, "str", np.dtype(np.uint8))
    if type(value) is bytes:
        return Leaf(path, "bytes", np.dtype(np.uint8))
    if type(value) is list:  # numbers: a ragged column; anything else: pickled whole
        kind = numeric_list(value)
        return Leaf(path, "pickle" if kind is None else kind or "intlist", np.dtype(np.uint8))
    if type(value) in (tuple, dict):
        return None
    return Leaf(path, "pickle", np.dtype(np.uint8))


def plain_tensor(value: torch.Tensor) -> torch.Tensor:
    """A tensor's data as a plain tensor that requires no grad (what its column stores)."""
    return value.as_subclass(torch.Tensor).detach()


def _all_int(values: list[Any]) -> bool:
    return all(type(v) is int for v in values)


def _all_float(values: list[Any]) -> bool:
    return all(type(v) is float for v in values)


def numeric_list(value: list[Any]) -> str | None:
    """Return "intlist" or "floatlist" for a flat list of ints or floats, "" if empty, else None."""
    if not value:
        return ""
    if _all_int(value):
        return "intlist"
    if _all_float(value):
        return "floatlist"
    return None


def infer_schema(item: Any, path: str, leaves: list[Leaf]) -> Any:
    """A tree mirroring ``item``: ("leaf", n) | ("tuple"|"list", [..]) | ("dict", [(k, ..)])."""
    leaf = classify(item, path)
    if leaf is not None:
        leaves.append(leaf)
        return ("leaf", len(leaves) - 1)
    if isinstance(item, dict):
        return ("dict", [(k, infer_schema(v, _join(path, k), leaves)) for k, v in item.items()])
    kind = "tuple" if isinstance(item, tuple) else "list"
    return (kind, [infer_schema(v, _join(path, i), leaves) for i, v in enumerate(item)])


def _join(path: str, key: Any) -> str:
    """Column names: ``"image"``, ``"0"``, ``"meta.boxes"``."""
    return f"{path}.{key}" if path else str(key)


def flatten(item: Any, node: Any, out: list[Any], index: int, where: str = "") -> None:
    """Append ``item``'s leaf values to ``out`` in schema order, checking its structure."""
    tag, body = node
    if tag == "leaf":
        out.append(item)
        return
    expected = {"dict": dict, "tuple": tuple, "list": list}[tag]
    if type(item) is not expected:
        raise ItemMismatchError(
            f"item {index}, field {field_name(where)}: expected a {expected.__name__} as in "
            f"item 0, got {describe_value(item)}. Every item must have the same structure."
        )
    if tag == "dict":  # the keys of item 0, in any order
        if len(item) != len(body) or any(k not in item for k, _ in body):
            raise ItemMismatchError(
                f"item {index}, field {field_name(where)}: keys {list(item)} differ from item 0's "
                f"{[k for k, _ in body]}."
            )
        for key, child in body:
            flatten(item[key], child, out, index, _join(where, key))
        return
    if len(item) != len(body):
        raise ItemMismatchError(
            f"item {index}, field {field_name(where)}: {len(item)} elements, item 0 had "
            f"{len(body)}."
        )
    for i, (value, child) in enumerate(zip(item, body)):
        flatten(value, child, out, index, _join(where, i))


def rebuild(node: Any, values: Sequence[Any], batch: bool = False) -> Any:
    """The item for ``node`` of a schema from its leaf values (the inverse of flattening).

    Dicts come back with item 0's keys in item 0's order. ``batch``: the batch the
    default collate makes from the leaves' batches (tuples become lists, as there).
    """
    tag, body = node
    if tag == "leaf":
        return values[body]
    if tag == "dict":
        return {k: rebuild(child, values, batch) for k, child in body}
    built = [rebuild(child, values, batch) for child in body]
    return tuple(built) if tag == "tuple" and not batch else built


def nest_paths(names: Sequence[str], paths: Sequence[tuple[str, ...]]) -> Any:
    """The schema (as :func:`infer_schema` gives) of items where column ``k`` is at ``paths[k]``.

    Note [Nested items]
    -------------------
    With ``nested=True`` a column dataset (Arrow, Parquet, HDF5) gives each column's
    value at its key path instead of under its flat name: Arrow's ``s.b.c`` (the
    path of struct fields ``("s", "b", "c")``) and HDF5's ``rec/b/c`` both come back
    as ``item["s"]["b"]["c"]``. The columns stay flat in shared memory and in the
    gathered batch; only the item (or batch) is built from this schema by
    :func:`rebuild`, dicts in the order of each key's first column. The default
    collate's shortcut (``_batch.py``) recognises its own nested samples with
    :func:`unnest`. Only the shape of items changes, so the option is not part of a
    dataset's identity for node sharing.

    Example:
        >>> node = nest_paths(["s.a", "y", "s.b"], [("s", "a"), ("y",), ("s", "b")])
        >>> rebuild(node, [1, 2, 3])
        {'s': {'a': 1, 'b': 3}, 'y': 2}

    Raises:
        InvalidArgumentError: one column's path is a prefix of another's (a value and
            a dict at the same key), or two columns have the same path.
    """
    root: dict[str, Any] = {}
    owner: dict[tuple[str, ...], str] = {}
    for k, (name, path) in enumerate(zip(names, paths)):
        node = root
        for depth in range(len(path)):
            key, prefix = path[depth], tuple(path[: depth + 1])
            last = depth == len(path) - 1
            if prefix in owner or (last and key in node):
                other = owner.get(prefix) or next(
                    n for n, p in zip(names, paths) if tuple(p[: depth + 1]) == prefix
                )
                raise InvalidArgumentError(
                    f"nested=True cannot place column {name!r}: column {other!r} is already "
                    f"at {'/'.join(prefix)!r}. Select one of them, or use nested=False."
                )
            if last:
                node[key] = k
                owner[prefix] = name
            else:
                node = node.setdefault(key, {})

    def schema(node: dict[str, Any]) -> Any:
        return (
            "dict",
            [(k, ("leaf", v) if isinstance(v, int) else schema(v)) for k, v in node.items()],
        )

    return schema(root)


def unnest(item: Any, node: Any, out: list[Any]) -> bool:
    """Put each leaf value of ``item`` at its column's place in ``out`` (undoes :func:`rebuild`).

    Returns False, leaving ``out`` partly filled, where ``item`` no longer has the
    schema's structure (a key added, removed or replaced by a non-dict; a tuple or
    list of another length).
    """
    tag, body = node
    if tag == "leaf":
        out[body] = item
        return True
    if tag == "dict":
        if not isinstance(item, dict) or len(item) != len(body):
            return False
        return all(key in item and unnest(item[key], child, out) for key, child in body)
    if not isinstance(item, tuple if tag == "tuple" else list) or len(item) != len(body):
        return False
    return all(unnest(value, child, out) for value, child in zip(item, body))


def check_leaf(leaf: Leaf, value: Any, index: int) -> None:
    """Raise :class:`ItemMismatchError` unless ``value`` can go in ``leaf``'s column."""
    if leaf.kind == "pickle":
        return  # anything picklable
    got = classify(value, leaf.path)
    if got is None:
        ok = False
    elif leaf.kind in ("intlist", "floatlist"):
        ok = got.kind in ("intlist", "floatlist", "") and (not value or got.kind == leaf.kind)
    else:
        ok = got.kind == leaf.kind
        if ok and leaf.kind in ("tensor", "ndarray", "npscalar"):
            ok = (
                got.dtype == leaf.dtype
                and got.torch_dtype == leaf.torch_dtype
                and got.tensor_type is leaf.tensor_type
                and got.requires_grad == leaf.requires_grad
                and got.array_dtype == leaf.array_dtype
            )
    if not ok:
        raise ItemMismatchError(
            f"item {index}, field {field_name(leaf.path)}: expected {describe_leaf(leaf)} as in "
            f"item 0, got {describe_value(value)}. Make every item return the same types (cast "
            "in the dataset), or wrap the value in a type that pickles."
        )


# -- the fast path: Note [The per-item fast path] -----------------------------------------


def _condition(leaf: Leaf, n: int, v: str, env: dict[str, Any]) -> str | None:
    """Source of the test that the value in variable ``v`` surely fits leaf ``n``."""
    kind = leaf.kind
    if kind in ("tensor", "ndarray"):
        env[f"S{n}"] = leaf.shape
        if kind == "tensor":
            env[f"C{n}"] = leaf.tensor_type or torch.Tensor
            env[f"D{n}"] = leaf.torch_dtype
            test = f"type({v}) is C{n} and {v}.dtype is D{n}"
            test += f" and {v}.requires_grad is {leaf.requires_grad}"
            if leaf.tensor_type is not None:
                test += f" and not {v}.__dict__"
            ndim = "dim()"
        else:  # an np.memmap too; the item's own dtype (a big-endian one too)
            env[f"D{n}"] = leaf.dtype if leaf.array_dtype is None else leaf.array_dtype
            test, ndim = f"type({v}) in NDARRAYS and {v}.dtype == D{n}", "ndim"
        shape = f"{v}.{ndim} == {len(leaf.shape)}" if leaf.ragged else f"{v}.shape == S{n}"
        return f"{test} and {shape}"
    if kind == "npscalar":
        env[f"T{n}"], env[f"D{n}"] = leaf.dtype.type, leaf.dtype
        return f"type({v}) is T{n} and {v}.dtype == D{n}"
    if kind == "int":
        return f"type({v}) is int and {INT64_MIN} <= {v} <= {INT64_MAX}"
    if kind in ("float", "bool", "str", "bytes"):
        return f"type({v}) is {kind}"
    if kind in ("intlist", "floatlist"):
        return f"type({v}) is list and _all_{kind[:-4]}({v})"
    return None  # pickle: anything


def compile_fast_path(
    schema: Any, leaves: list[Leaf], sinks: list[list[Any]]
) -> Callable[[Any], bool]:
    """The fast path for ``schema``: append each leaf value to its sink, or return False.

    For ``(tensor, int, str)`` items it generates::

        def fast(item):
            if type(item) is not tuple or len(item) != 3: return False
            v0, v1, v2, = item
            if not (type(v0) is C0 and v0.dtype is D0 and v0.requires_grad is False
                    and v0.shape == S0): return False
            if not (type(v1) is int and -9223372036854775808 <= v1 <= ...): return False
            if not (type(v2) is str): return False
            A0(v0); A1(v1); A2(v2)
            return True

    Dict keys, dtypes and shapes are bound as globals of the function, never
    written into its source.
    """
    env: dict[str, Any] = {
        "NDARRAYS": (np.ndarray, np.memmap),
        "_all_int": _all_int,
        "_all_float": _all_float,
        "plain": plain_tensor,
    }
    lines: list[str] = []
    leaf_var: dict[int, str] = {}
    names = count()

    def visit(node: Any, var: str) -> None:
        tag, body = node
        if tag == "leaf":
            test = _condition(leaves[body], body, var, env)
            if test is not None:
                lines.append(f"if not ({test}): return False")
            leaf_var[body] = var
        elif tag == "dict":
            k = next(names)
            env[f"K{k}"] = tuple(key for key, _ in body)
            env[f"KS{k}"] = {key for key, _ in body}
            test = f"type({var}) is not dict or (tuple({var}) != K{k} and {var}.keys() != KS{k})"
            lines.append(f"if {test}: return False")  # item 0's keys, in any order
            for j, (key, child) in enumerate(body):
                env[f"K{k}_{j}"] = key
                sub = f"v{next(names)}"
                lines.append(f"{sub} = {var}[K{k}_{j}]")
                visit(child, sub)
        else:
            lines.append(f"if type({var}) is not {tag} or len({var}) != {len(body)}: return False")
            subs = [f"v{next(names)}" for _ in body]
            if subs:
                lines.append(f"{', '.join(subs)}, = {var}")
            for sub, child in zip(subs, body):
                visit(child, sub)

    visit(schema, "item")
    for n, sink in enumerate(sinks):
        env[f"A{n}"] = sink.append
        leaf = leaves[n]
        special = leaf.kind == "tensor" and (leaf.tensor_type or leaf.requires_grad)
        lines.append(f"A{n}(plain({leaf_var[n]}))" if special else f"A{n}({leaf_var[n]})")
    source = "def fast(item):\n" + "".join(f"    {line}\n" for line in [*lines, "return True"])
    exec(compile(source, "<SharedDataset fast path>", "exec"), env)
    return env["fast"]  # type: ignore[no-any-return]
