"""Arrays as the readers make them: an index into a tensor with explicit bounds, the shapes
NumPy refuses, and host buffers aligned so that a device adopts them without a copy."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from ..._text import short
from ._keys import ALIGN_FOR_DEVICE
from ._spans import Span, describe

MAX_NDIM = 64


# Offers the buffer a tensor (or a span of one) is read into: (its key, shape, dtype) -> an
# array, or None for a buffer of its own (see `buffer_for`).
Into = Callable[["str | Span", tuple[int, ...], np.dtype], "np.ndarray | None"]


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


def buffer_for(
    name: str | Span, shape: tuple[int, ...], dtype: np.dtype, into: Into | None
) -> np.ndarray:
    """The buffer tensor (or span) `name` is read into: the one `into` offers (a C-contiguous
    array of exactly its shape and dtype), else an aligned buffer of its own."""
    offered = None if into is None else into(name, shape, dtype)
    if offered is None:
        return aligned_empty(shape, dtype)
    if offered.shape != shape or offered.dtype != dtype or not offered.flags.c_contiguous:
        raise ValueError(
            f"a buffer for {describe(name)} must be a C-contiguous {dtype}{list(shape)}, "
            f"got {offered.dtype}{list(offered.shape)}"
        )
    return offered
