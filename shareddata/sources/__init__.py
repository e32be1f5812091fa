"""Source formats: each module only sizes columns and fills the buffers it is given.

* ``npy``: NumPy ``.npy`` / ``.npz`` / folders / in-memory arrays.
"""
