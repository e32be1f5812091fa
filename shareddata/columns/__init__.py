"""Columns: typed views over shared arrays, and how an item splits into them.

- ``_columns``: fixed-shape, ragged, string, bytes and UUID columns;
- ``_nested``: nested lists and lists of records (offsets per level, typed leaves);
- ``_sparse``: rows of a CSR matrix, dense or ``torch.sparse_coo``;
- ``_items``: an item's structure, its leaves (one column each), and given back.
"""
