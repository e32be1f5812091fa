"""Materialising any map-style dataset into shared columns (what ``SharedDataset`` runs).

Each item is split into leaves along a schema inferred from the first item; each
leaf is a column. ``_builder``: the items checked, adapted and written, variable-length
values to growing shared files; ``_writer``: fixed-size rows written by a background
thread, or by DataLoader workers in blocks (Note [Materialising with workers]).
"""

from ...errors import ItemMismatchError, ItemValueError  # their old import location
from ._builder import DatasetProducer

__all__ = ["DatasetProducer", "ItemMismatchError", "ItemValueError"]
