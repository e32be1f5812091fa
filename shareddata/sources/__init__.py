"""Source formats: each module only sizes columns and fills the buffers it is given.

* ``npy``: NumPy ``.npy`` / ``.npz`` / folders / in-memory arrays.
* ``hdf5``: datasets of an HDF5 file (h5py), numeric, string and variable-length.
* ``arrow``: the one Arrow source, over an input's schema, rows and record batches:
  in-memory tables (``_arrow_table``), IPC files and HF folders (``_arrow_ipc``),
  Parquet (``parquet``, files found by ``_parquet_files``); Arrow types -> column kinds
  (``_arrow_types``, ``_arrow_extensions``), the sizing pass and the copy
  (``_arrow_columns``, lists of records: ``_arrow_nested``).
"""
