"""Source formats: each module only sizes columns and fills the buffers it is given.

* ``npy``: NumPy ``.npy`` / ``.npz`` / folders / in-memory arrays.
* ``hdf5``: datasets of an HDF5 file (h5py), numeric, string and variable-length.
* ``arrow``: in-memory Arrow tables (pyarrow, or any Arrow stream/array producer);
  what Parquet shares with it: ``_arrow_types`` (Arrow type -> column kind),
  ``_arrow_select`` (struct fields -> columns, selection), ``_arrow_columns`` (sizing
  and the copy into buffers), ``_arrow_nested`` (lists of records, strings, lists).
* ``parquet``: Parquet files, lists and folders of them (pyarrow), copied one row
  group x one column at a time.
"""
