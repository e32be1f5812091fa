"""Source formats: each module only sizes columns and fills the buffers it is given.

``npy``: NumPy files and arrays; ``hdf5``: HDF5 files; ``arrow``: the one Arrow source
over tables, ``_arrow_ipc`` (IPC files, HF folders) and ``parquet``; ``_arrow_types``:
Arrow types -> column kinds; ``_arrow_columns``: the sizing pass and the copy.
"""
