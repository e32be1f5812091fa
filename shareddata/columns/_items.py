"""An item of a wrapped dataset: its schema, its leaves (one column each), and back.

Note [The per-item fast path]
=============================
Materialising must cost little more than iterating the dataset once, so the work per
item is one call to a function generated for the schema (as ``dataclasses`` generates
``__init__``): it tests the item's structure and each leaf's exact type, dtype and
fixed shape, and appends the values to per-column lists. It accepts only what surely
matches the columns as they stand; anything else takes the checked path
(``Builder._add_checked`` in ``_materialise/_builder.py``), which names the index and
field of a difference, or adapts a column (ragged, pickled) and recompiles.

Note [What comes back]
======================
``SharedDataset`` gives back what the item had, not what the column holds: a tensor
as its class (``as_subclass``) with its ``requires_grad`` (a leaf; a subclass that
cannot be rebuilt from its data, with attributes or its own ``__torch_dispatch__``, is
pickled whole); a numpy array as an ``ndarray`` of its own dtype, byte order included
(``np.memmap`` too, in memory); a dict with item 0's keys in item 0's order. A batch is
what the default collate makes of those items: where a column's gathered batch IS
that (plain tensors, native arrays, Python and numpy numbers) the shortcut takes it as
gathered (Note [The default collate's shortcut] in ``crossing/_collate.py``); every
other leaf gives its rows, collated as ``default_collate`` would collate the originals.
"""

from __future__ import annotations

import operator
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import count
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError, ItemMismatchError
from ..storage import SharedTensor, to_numpy_dtype
from ._columns import as_is

__all__ = [
    "FIXED", "INT64_MAX", "INT64_MIN", "Leaf", "LeafType", "check_leaf", "classify",
    "compile_fast_path", "describe_leaf", "describe_value", "field_name", "flatten",
    "host_numpy", "infer_schema", "leaf_batches", "nest_paths", "numeric_list",
    "plain_tensor", "rebuild", "restore", "unnest",
]  # fmt: skip


# A leaf's ``kind``: tensor / ndarray / npscalar / int / float / bool are fixed rows
# (ragged values + shapes when shapes vary); str / bytes; intlist / floatlist (ragged);
# pickle (bytes of pickled objects).
FIXED = {"tensor", "ndarray", "npscalar", "int", "float", "bool"}
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass
class Leaf:
    """One leaf of the schema (``dtype``: the column's).

    ``tensor_type``: a tensor's class if not ``torch.Tensor``; ``array_dtype``: an
    array's own dtype if not native (``>i4``; Note [What comes back]).
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


_STORED_AS = {torch.bfloat16: torch.int16}  # dtypes numpy lacks -> the dtype of their bits


def host_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's values as a numpy array on the host (a bfloat16 one's bits as int16)."""
    tensor = tensor.detach().cpu()
    stored = _STORED_AS.get(tensor.dtype)
    return (tensor if stored is None else tensor.view(stored)).numpy()


_PICKLED = "USVMm"  # numpy kinds a tensor cannot hold (strings, records, datetimes)


def classify(value: Any, path: str) -> Leaf | None:
    """The leaf for ``value``, or None when it is a structure (tuple, list, dict)."""
    if isinstance(value, torch.Tensor):
        if value.layout is not torch.strided or value.is_quantized or value.is_nested:
            return Leaf(path, "pickle", np.dtype(np.uint8))  # sparse, quantized: kept whole
        cls = type(value)
        # a subclass comes back from its data (as_subclass) unless it wraps other
        # tensors (its own __torch_dispatch__) or has attributes: kept whole then
        dispatch = getattr(cls, "__torch_dispatch__", None)
        if cls is not torch.Tensor and (
            dispatch is not torch.Tensor.__torch_dispatch__ or value.__dict__
        ):
            return Leaf(path, "pickle", np.dtype(np.uint8))
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
    for number, stored in ((bool, np.bool_), (int, np.int64), (float, np.float64)):
        if isinstance(value, number):
            return Leaf(path, number.__name__, np.dtype(stored))
    if type(value) in (str, bytes):
        return Leaf(path, type(value).__name__, np.dtype(np.uint8))
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
    """A flat list's kind, ``intlist`` or ``floatlist``; ``""`` if empty, else None."""
    if not value:
        return ""
    return "intlist" if _all_int(value) else "floatlist" if _all_float(value) else None


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

    ``batch``: rebuild a batch from the leaves' batches (tuples become lists, as in
    the default collate).
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
    With ``nested=True`` a column dataset gives each column's value at its key path
    (Arrow's ``s.b.c``, HDF5's ``rec/b/c``: ``item["s"]["b"]["c"]``). The columns stay
    flat in shared memory and in the gathered batch; only the item (or batch) is built
    from this schema by :func:`rebuild`, and the collate's shortcut recognises its own
    samples with :func:`unnest`. Only the items' shape changes, so the option is not
    part of a dataset's identity for node sharing.

    Example:
        >>> node = nest_paths(["s.a", "y", "s.b"], [("s", "a"), ("y",), ("s", "b")])
        >>> rebuild(node, [1, 2, 3])
        {'s': {'a': 1, 'b': 3}, 'y': 2}

    Raises:
        InvalidArgumentError: one column's path is a prefix of another's (a value and
            a dict at the same key), or two columns have the same path.
    """
    root: dict[str, Any] = {}
    placed: dict[tuple[str, ...], tuple[int, bool]] = {}  # first column there, ends there
    for k, (name, path) in enumerate(zip(names, paths)):
        node = root
        for depth, key in enumerate(path):
            prefix, last = tuple(path[: depth + 1]), depth == len(path) - 1
            other, ends = placed.setdefault(prefix, (k, last))
            if other != k and (ends or last):
                raise InvalidArgumentError(
                    f"nested=True cannot place column {name!r}: column {names[other]!r} is "
                    f"already at {'/'.join(prefix)!r}. Select one of them, or use nested=False."
                )
            if last:
                node[key] = k
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

    False (``out`` partly filled) where ``item`` no longer has the schema's structure.
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


_VALUE_TYPE = operator.attrgetter(
    "kind", "dtype", "torch_dtype", "tensor_type", "requires_grad", "array_dtype"
)


def check_leaf(leaf: Leaf, value: Any, index: int) -> None:
    """Raise :class:`ItemMismatchError` unless ``value`` can go in ``leaf``'s column."""
    if leaf.kind == "pickle":
        return  # anything picklable
    got = classify(value, leaf.path)
    if got is None:
        ok = False
    elif leaf.kind in ("intlist", "floatlist"):
        ok = got.kind in ("intlist", "floatlist", "") and (not value or got.kind == leaf.kind)
    else:  # the same kind, and for tensors and arrays the same dtypes, class and grad
        ok = _VALUE_TYPE(got) == _VALUE_TYPE(leaf)
    if not ok:
        raise ItemMismatchError(
            f"item {index}, field {field_name(leaf.path)}: expected {describe_leaf(leaf)} as in "
            f"item 0, got {describe_value(value)}. Make every item return the same types (cast "
            "in the dataset), or wrap the value in a type that pickles."
        )


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

    For ``(tensor, int, str)`` items it generates ``if type(item) is not tuple or
    len(item) != 3: return False``, ``v0, v1, v2, = item``, a test per value, then
    ``A0(v0); A1(v1); A2(v2)``. Keys, dtypes and shapes are bound as globals of the
    function, never written into its source.
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


@dataclass(frozen=True)
class LeafType:
    """What a leaf's values were in the items (Note [What comes back]).

    ``kind`` is a :class:`Leaf`'s, or ``bfloat16`` (a tensor stored as its bits);
    ``ragged``: a values column, then a ``.shape`` column; ``dtype``: an array's own
    dtype where not native; ``collated``: the gathered batch is what the default
    collate makes of the values.
    """

    kind: str
    ragged: bool = False
    cls: type | None = None
    requires_grad: bool = False
    dtype: np.dtype | None = None
    collated: bool = False

    @classmethod
    def of(cls, leaf: Leaf) -> LeafType:
        """The type of ``leaf``'s values, once every item is read."""
        kind = "bfloat16" if leaf.torch_dtype is torch.bfloat16 else leaf.kind
        plain = leaf.tensor_type is None and not leaf.requires_grad
        collated = not leaf.ragged and (
            kind in ("int", "float", "bool")
            or (kind in ("tensor", "bfloat16") and plain)
            or (kind == "ndarray" and leaf.array_dtype is None)
            or (kind == "npscalar" and _scalars_collate(leaf.dtype))
        )
        return cls(
            kind, leaf.ragged, leaf.tensor_type, leaf.requires_grad, leaf.array_dtype, collated
        )


def _scalars_collate(dtype: np.dtype) -> bool:
    """Whether the default collate makes a tensor of ``dtype`` of numpy scalars of it."""
    try:
        got = torch.as_tensor([dtype.type(0)])
    except (TypeError, RuntimeError):  # np.uint64: "an integer is required"
        return False
    return got.dtype == torch.from_numpy(np.zeros(0, dtype)).dtype


def restore(t: LeafType, value: Any) -> Any:
    """A leaf value as the item had it, from what its column gives (a row, or a view of one).

    Example:
        >>> p = restore(LeafType("tensor", cls=torch.nn.Parameter), torch.ones(2))
        >>> type(p).__name__, p.requires_grad
        ('Parameter', False)
        >>> restore(LeafType("ndarray", dtype=np.dtype(">i4")), torch.arange(2)).dtype.str
        '>i4'
    """
    kind = t.kind
    if kind == "tensor" or kind == "bfloat16":
        if kind == "bfloat16":  # stored as its bits (int16)
            value = value.view(torch.bfloat16)
        if t.cls is None and not t.requires_grad:
            return value
        if type(value) is SharedTensor:
            # a view of a worker's batch: torch would move its storage into a segment
            # of its own, in place, from under the batch's memfd: a copy of its own
            value = value.as_subclass(torch.Tensor).clone()
        if t.cls is not None:
            value = value.as_subclass(t.cls)
        return value.requires_grad_() if t.requires_grad else value  # a leaf tensor
    if kind == "ndarray":
        array = value.numpy()
        return array if t.dtype is None else array.astype(t.dtype)
    if kind == "npscalar":
        return value.numpy()[()]
    if kind in ("int", "float", "bool"):
        return value.item()
    if kind in ("intlist", "floatlist"):
        return value.tolist()
    if kind == "pickle":
        return pickle.loads(value)
    return value  # str, bytes


# A batch's rows, and its row 0 alone (Note [Samples made when first used] in
# crossing/_collate.py): module-level, a batch that crosses as its columns pickles them.


def unbind_rows(batch: torch.Tensor) -> list[Any]:
    return list(batch.unbind(0))


def item_rows(batch: torch.Tensor) -> list[Any]:
    return batch.tolist()  # type: ignore[no-any-return]


def array_rows(batch: torch.Tensor) -> list[Any]:
    array = batch.numpy()  # ndarray views (0-d arrays for a batch of 0-d arrays)
    return [array[i, ...] for i in range(len(array))]


def scalar_rows(batch: torch.Tensor) -> list[Any]:
    return list(batch.numpy())


def row_0(split: Callable[[Any], list[Any]], batch: torch.Tensor) -> Any:
    """Row 0 alone as ``split`` cuts the rows (without cutting the others)."""
    return split(batch[:1])[0]


_ROWS: dict[str, tuple[Callable[[Any], list[Any]], Callable[[Any], Any]]] = {
    "tensor": (unbind_rows, operator.itemgetter(0)),
    "bfloat16": (unbind_rows, operator.itemgetter(0)),
    "ndarray": (array_rows, partial(row_0, array_rows)),
    "npscalar": (scalar_rows, partial(row_0, scalar_rows)),
    "int": (item_rows, partial(row_0, item_rows)),
    "float": (item_rows, partial(row_0, item_rows)),
    "bool": (item_rows, partial(row_0, item_rows)),
}


def leaf_batches(
    types: list[LeafType], batched: list[Any]
) -> tuple[list[Any], list[bool], list[Callable[[Any], Any]], list[Callable[[Any], Any] | None]]:
    """Each leaf's batch from its columns' gathered batches (in column order).

    Per leaf: its batch (the gathered tensor where that is the default collate's
    result, else the list of its restored rows), whether it is that tensor, the
    function that cuts it into rows and the one that makes row 0 alone (None: row 0).

    Example:
        >>> types = [LeafType("int", collated=True), LeafType("str")]
        >>> batched = [torch.tensor([4, 2]), ["a", "b"]]
        >>> values, stacked, splits, firsts = leaf_batches(types, batched)
        >>> stacked, splits[0](values[0]), firsts[0](values[0]), splits[1](values[1])
        ([True, False], [4, 2], 4, ['a', 'b'])
    """
    leaves: list[tuple[Any, bool, Callable[[Any], Any], Callable[[Any], Any] | None]] = []
    columns = iter(batched)
    for t in types:
        batch = next(columns)
        if t.collated:
            batch = batch.view(torch.bfloat16) if t.kind == "bfloat16" else batch
            leaves.append((batch, True, *_ROWS[t.kind]))
            continue
        if t.ragged:  # 1-D views of each row's values, and the rows' shapes
            shapes = next(columns).tolist()
            rows = [restore(t, v.reshape(s)) for v, s in zip(batch, shapes)]
        elif isinstance(batch, torch.Tensor):  # fixed rows the default collate takes one by one
            rows = [restore(t, v) for v in batch.unbind(0)]
        elif t.kind in ("str", "bytes"):
            rows = batch
        else:
            rows = [restore(t, v) for v in batch]
        leaves.append((rows, False, as_is, None))
    if not leaves:
        return [], [], [], []
    values, stacked, splits, firsts = map(list, zip(*leaves))
    return values, stacked, splits, firsts
