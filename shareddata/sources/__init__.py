"""Source formats: each module only sizes columns and fills the buffers it is given.

* ``npy``: NumPy ``.npy`` / ``.npz`` / folders / in-memory arrays.
* ``hdf5``: datasets of an HDF5 file (h5py), numeric, string and variable-length.
* ``arrow``: in-memory Arrow tables (pyarrow, or any Arrow stream/array producer);
  ``_arrow_columns`` / ``_arrow_nested``: the Arrow type -> column kind mapping and
  the copy into buffers that Parquet shares.
* ``parquet``: Parquet files, lists and folders of them (pyarrow), copied one row
  group x one column at a time.
"""
