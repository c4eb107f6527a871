"""Arrays as the readers make them: an index into a tensor with explicit bounds, the shapes
NumPy refuses, and host buffers aligned so that a device adopts them without a copy."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..._text import short
from ._keys import ALIGN_FOR_DEVICE

MAX_NDIM = 64


def normalize_index(index: Sequence[slice], shape: Sequence[int]) -> tuple[slice, ...]:
    """`index` with explicit, clipped bounds in every dimension (a sharding's slices use None)."""
    if len(index) != len(shape):
        raise ValueError(f"index {short(index)} does not match a tensor of shape {list(shape)}")
    return tuple(slice(*s.indices(d)[:2]) for s, d in zip(index, shape, strict=True))


def too_big(shape: Sequence[int], itemsize: int) -> bool:
    """Whether NumPy would refuse to make an array of this shape even when it is empty (it
    bounds the product of the dimensions counted as at least 1, in bytes)."""
    return math.prod(max(d, 1) for d in shape) * max(itemsize, 1) >= 2**62


def aligned_empty(shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary: XLA's CPU client then
    adopts it without a copy when it is placed on a device (`jax.device_put`)."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN_FOR_DEVICE, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN_FOR_DEVICE
    return raw[start : start + nbytes].view(dtype).reshape(shape)
