"""A tensor as large as a restore's window, read and placed piece by piece.

Onto an accelerator a restore reads each tensor into a block of the pinned arena
(`_pinned`) and frees the block once the tensor is on its device. A tensor that takes the
whole window (and the whole arena: both are 256 MiB by default) is then read, sent, and
only then followed by the next one, which waits for the room: reading and transferring,
which overlap for smaller tensors, take turns, and an 8 GiB state of 256 MiB leaves
restores at the sum of their speeds rather than the slower one's.

So a tensor larger than a quarter of the window (the share of one group of
`_transfer.windowed_reads`) whose checksum is in parts (format version 3) is read as
spans of its parts (`FileReader.spans`), each a flat array of a quarter of the window at
most: each span is read (each part verified by its reader, as for a whole tensor), sent
to the device and its block freed on its own, the next spans read meanwhile; the pieces
are joined on the device (one concatenation there, at the device memory's speed), then
placed as the target leaf is (`place`). Only a leaf that one device holds whole, with no
cast or transform, taken by one target leaf, is read in pieces: a sharded leaf's transfer
goes to several devices from one host buffer, which pieces would route through one.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..format._spans import Span
from . import _pinned

if TYPE_CHECKING:
    import jax
    import jax.numpy as jnp
else:  # imported on first use: the command line reads headers without JAX
    from ..._lazy import LazyModule

    jax = LazyModule("jax")
    jnp = LazyModule("jax.numpy")


class Pieces:
    """Which saved tensors of a restore are read as spans, and their pieces on the device
    until the last one arrives. `units` is what the read stage reads: each tensor's name,
    or its spans in order."""

    def __init__(
        self, reader: Any, names: Sequence[str], candidates: dict[str, Any], share: int
    ) -> None:
        """Arguments: the restore's `reader`; the saved `names` it reads whole, in order;
        `candidates`, saved name -> the one target leaf it fills, for those read into a
        pinned block with neither cast nor transform; and `share`, the most bytes of one
        span."""
        self.units: list[str | Span] = []
        self.devices: dict[str, Any] = {}  # saved name -> the one device its leaf is on
        self.arrived: dict[str, list[Any]] = {}
        self._count: dict[str, int] = {}
        spans_of = getattr(reader, "spans", None)
        for name in names:
            spans, device = None, None
            if spans_of is not None and name in candidates:
                device = _one_device(candidates[name])
                spans = None if device is None else spans_of(name, share)
            if spans is None:
                self.units.append(name)
                continue
            self.units.extend(spans)
            self.devices[name] = device
            self._count[name] = len(spans)
            self.arrived[name] = []

    def place(self, span: Span, host: np.ndarray) -> jax.Array:
        """Starts the transfer of `span`'s bytes `host` to its tensor's device: a piece,
        uncommitted there (as the pieces' join will be)."""
        with jax.default_device(self.devices[span.name]):
            return jax.device_put(host)

    def add(self, span: Span, piece: jax.Array, shape: tuple[int, ...]) -> jax.Array | None:
        """Keeps `piece` (span `span`'s, in order); once its tensor's last piece is in, returns
        the pieces joined on the device as the tensor, of `shape`."""
        pieces = self.arrived[span.name]
        pieces.append(piece)
        if len(pieces) < self._count[span.name]:
            return None
        del self.arrived[span.name]
        with jax.default_device(self.devices[span.name]):
            return _join(tuple(pieces), shape)


@functools.cache
def _joiner() -> Any:
    # One compilation per tensor shape (the leaves of a model repeat a few shapes).
    return jax.jit(lambda pieces, shape: jnp.concatenate(pieces).reshape(shape), static_argnums=1)


def _join(pieces: tuple[jax.Array, ...], shape: tuple[int, ...]) -> jax.Array:
    return _joiner()(pieces, shape)


def _one_device(target: Any) -> Any | None:
    """The device of a target array leaf that one accelerator device holds whole, else
    None (a NumPy target, one placed over several devices or in host memory)."""
    device = _pinned.target_device(target)
    sharding = getattr(target, "sharding", None)
    if device is None or (sharding is not None and len(sharding.device_set) != 1):
        return None
    dtype = np.dtype(target.dtype)
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
        return None  # (float64 without x64: placed as float32, as `device_put` does)
    return device
