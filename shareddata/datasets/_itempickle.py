"""How ``SharedList`` pickles its items: plain tensors as their values.

Note [Tensors in SharedList items]
----------------------------------
``pickle`` hands a tensor to torch's own ``__reduce_ex__``, which writes the tensor's
whole storage in ``torch.save``'s format: unpickling it runs ``torch.load`` (~80-130 us
for a 1 KiB tensor, most of a ``SharedList`` batch's time in a worker), and a view
(``rows[i]`` of a big tensor) pickles every row of its storage, not its own. So
``SharedList`` pickles with a pickler of its own whose dispatch table (this pickler's
only, never ``copyreg``'s or ``ForkingPickler``'s) sends a plain CPU tensor as a numpy
array of its values, rebuilt with ``torch.from_numpy``: ~10 us, and only the view's
bytes. What comes back is a ``torch.Tensor`` of the same dtype, shape and values,
contiguous, with a storage of its own (two tensors of one item that shared a
storage no longer do). A dtype numpy lacks (``bfloat16``, float8, ``complex32``)
goes as its bytes, viewed back as that dtype: torch's own pickle of float8 and
``complex32`` tensors cannot be loaded. Any other tensor (a subclass,
``requires_grad``, attributes set on it, conjugate or negative views, another
device) is pickled by torch, as before.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from typing import Any

import numpy as np
import torch

__all__ = ["ItemPickler"]


class ItemPickler:
    """Pickles items one after another; plain CPU tensors as numpy arrays of their values.

    Example:
        >>> dumps = ItemPickler().dumps
        >>> rows = torch.arange(12.0).reshape(4, 3)
        >>> back = pickle.loads(dumps({"row": rows[1], "n": 1}))
        >>> back, back["row"].untyped_storage().nbytes()
        ({'row': tensor([3., 4., 5.]), 'n': 1}, 12)
    """

    def __init__(self) -> None:
        self._buffer = io.BytesIO()
        self._pickler = pickle.Pickler(self._buffer, pickle.HIGHEST_PROTOCOL)
        table = copyreg.dispatch_table.copy()
        table[torch.Tensor] = _reduce_tensor  # exact type: subclasses are torch's
        self._pickler.dispatch_table = table  # type: ignore[misc]

    def dumps(self, item: Any) -> bytes:
        """``item`` pickled (Note [Tensors in SharedList items])."""
        buffer = self._buffer
        buffer.seek(0)
        buffer.truncate()
        self._pickler.clear_memo()
        self._pickler.dump(item)
        return buffer.getvalue()


def _reduce_tensor(tensor: torch.Tensor) -> Any:
    if (
        tensor.layout is torch.strided
        and tensor.device.type == "cpu"
        and not tensor.requires_grad
        and not tensor.is_conj()
        and not tensor.is_neg()
        and not tensor.__dict__
    ):
        try:
            array = tensor.numpy()
        except (TypeError, RuntimeError):  # a dtype numpy lacks: bfloat16, float8, complex32
            try:
                bits = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
            except (TypeError, RuntimeError):  # quantized...: torch's own pickle
                pass
            else:
                return tensor_from_bytes, (bits, tensor.dtype, tuple(tensor.shape))
        else:
            return tensor_from_array, (array,)
    return tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def tensor_from_array(array: np.ndarray) -> torch.Tensor:
    """A tensor of ``array``'s values (pickled in-band, a read-only array: copied)."""
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def tensor_from_bytes(bits: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of a dtype numpy lacks, from its bytes (torch's own pickle of one fails to load)."""
    return tensor_from_array(bits).view(dtype).reshape(shape)
