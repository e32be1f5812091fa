"""Materialising any map-style dataset into shared columns (what ``SharedDataset`` runs).

Each item is split into leaves along a schema inferred from the first item
(``_items.py``); each leaf becomes one column:

* fixed-size leaves (tensors and arrays of one shape and dtype, Python and numpy
  numbers) go into one segment sized up front, written block by block from a
  background thread (Note [Writing rows in the background] in ``_writer.py``);
* variable-length leaves (``str``, ``bytes``, lists of numbers, arrays whose shape
  varies, anything else pickled) are written to a growing shared file each as they
  come, which becomes the column's segment at the end (Note [Variable-length values
  go to shared memory as they come] in ``storage/_writer.py``); their offsets are copied into
  a last, small segment.

The segments are the loader's (``_load.build``), which frees them if anything
fails and shares them across the local ranks of a node.

Modules, one job each:

- ``_producer``: :class:`DatasetProducer`, what the loader calls, and
  :func:`build_columns`, which runs a builder over the items;
- ``_builder``: :class:`Builder`, the items checked against the schema, adapted
  (a leaf that turns ragged or pickled) and written into columns;
- ``_blocks``: the items read and written by DataLoader workers in blocks
  (Note [Materialising with workers]).
"""

from ...errors import ItemMismatchError, ItemValueError  # their old import location
from ._producer import DatasetProducer, build_columns

__all__ = ["DatasetProducer", "ItemMismatchError", "ItemValueError", "build_columns"]
