"""Columns: typed views over shared arrays, and how an item splits into them.

- ``_columns``: fixed-shape, ragged, string and bytes columns (one row, a gathered batch);
- ``_nested``: nested lists and lists of records (offsets per level, typed leaves);
- ``_items``: an item's structure, its leaves (one column each) and its rebuilding.
"""
