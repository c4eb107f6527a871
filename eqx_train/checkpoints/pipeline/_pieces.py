"""A tensor as large as a restore's window, read and placed piece by piece.

Onto an accelerator a restore reads each tensor into a block of the pinned arena
(`_pinned`) and frees the block once the tensor is on its device. A tensor that takes the
whole window (and the whole arena: both are 256 MiB by default) is then read, sent, and
only then followed by the next one, which waits for the room: reading and transferring,
which overlap for smaller tensors, take turns, and an 8 GiB state of 256 MiB leaves
restores at the sum of their speeds rather than the slower one's.

So a tensor larger than a quarter of the window or of the arena, whichever is smaller (the
share of one group of `_transfer.windowed_reads`), whose checksum is in parts (format
version 3), is read as spans of its parts (`FileReader.spans`), each a flat array of at most
that share (but at least one part): each span is read (each part verified by its reader, as
for a whole tensor), sent to the device and its block freed on its own, the next spans read
meanwhile; the pieces are joined on the device (one concatenation there, at the device
memory's speed), then placed as the target leaf is (`place`). Only a leaf that one device
holds whole, with no cast or transform, taken by one target leaf, is read in pieces: a
sharded leaf's transfer goes to several devices from one host buffer, which pieces would
route through one. A device that reports too little free memory to hold a tensor twice
(its pieces, then them joined) beside what the restore places before it gets it whole.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
from collections.abc import Iterator, Sequence
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
        self,
        reader: Any,
        available: dict[str, tuple[tuple[int, ...], np.dtype]],
        names: Sequence[str],
        candidates: dict[str, tuple[Any, int, int]],
    ) -> None:
        """Arguments: the restore's `reader` and its saved arrays, `available` (name ->
        shape and dtype); the saved `names` it reads whole, in order; `candidates`, saved
        name -> (the one target leaf it fills, the most bytes of one of its spans, the most
        a span may have to be read into the pinned arena), for those read into a pinned block
        with neither cast nor transform."""
        self.units: list[str | Span] = []
        self._devices: dict[str, Any] = {}  # saved name -> the one device its leaf is on
        self._arrived: dict[str, list[Any]] = {}
        self._count: dict[str, int] = {}
        self._joins: dict[str, _Join] = {}
        spans_of = getattr(reader, "spans", None)
        room = _Room()
        for name in names:
            spans, device = None, None
            if spans_of is not None and name in candidates:
                target, most, fits = candidates[name]
                device = _one_device(target)
                spans = None if device is None else spans_of(name, most)
                if spans is not None and max(s.nbytes for s in spans) > fits:
                    spans = None  # no span would come from the arena: nothing to gain
            if device is not None:
                nbytes = math.prod(available[name][0]) * available[name][1].itemsize
                if spans is not None and not room.to_join(device, nbytes):
                    spans = None
                room.placed(device, nbytes)
            if spans is None:
                self.units.append(name)
                continue
            self.units.extend(spans)
            self._devices[name] = device
            self._count[name] = len(spans)
            self._arrived[name] = []
            shape, dtype = available[name]
            sizes = tuple(s.nbytes // dtype.itemsize for s in spans)
            self._joins[name] = _Join.of(sizes, dtype, tuple(shape), device)

    def place(self, span: Span, host: np.ndarray) -> jax.Array:
        """Starts the transfer of `span`'s bytes `host` to its tensor's device: a piece,
        uncommitted there (as the pieces' join will be)."""
        with _on(self._devices[span.name]):
            return jax.device_put(host)

    def add(self, span: Span, piece: jax.Array, shape: tuple[int, ...]) -> jax.Array | None:
        """Keeps `piece` (span `span`'s, in order); once its tensor's last piece is in, returns
        the pieces joined on the device as the tensor, of `shape`."""
        pieces = self._arrived[span.name]
        pieces.append(piece)
        if len(pieces) < self._count[span.name]:
            return None
        del self._arrived[span.name]
        self._joins[span.name].compiled.wait()
        with _on(self._devices[span.name]):
            return _joiner()(tuple(pieces), shape)


@functools.cache
def _joiner() -> Any:
    # One compilation per tensor shape (the leaves of a model repeat a few shapes).
    return jax.jit(lambda pieces, shape: jnp.concatenate(pieces).reshape(shape), static_argnums=1)


class _Join:
    """The join of one kind of tensor (its pieces' lengths, dtype, shape and device),
    compiled ahead as soon as a restore knows it will need it, so that the compilation (a
    large part of a restore of a second or less) runs while the first spans are read
    rather than after the last one arrives. Made once per kind in a process (`of`): the
    compiled join stays in `jax.jit`'s cache. One compilation runs at a time in a process
    (beside the reads, not in their way)."""

    _lock = threading.Lock()
    _made: dict[tuple[Any, ...], _Join] = {}
    _turns: dict[int, threading.Lock] = {}  # process id -> one compilation at a time

    def __init__(
        self, sizes: tuple[int, ...], dtype: np.dtype, shape: tuple[int, ...], device: Any
    ):
        self.compiled = threading.Event()
        x64 = jax.enable_x64.value  # the caller's: a thread starts without it
        join = _joiner()  # made here, under `_lock`: each thread compiles into the one cache
        turn = _Join._turns.setdefault(os.getpid(), threading.Lock())

        def compile_join() -> None:
            try:
                pieces = tuple(jax.ShapeDtypeStruct((n,), dtype) for n in sizes)
                with turn, jax.enable_x64(x64), _on(device):
                    join.lower(pieces, shape).compile()
            except Exception:  # the join compiles (and fails, if it must) when it runs
                pass
            finally:
                self.compiled.set()

        name = "eqx_train-restore-join"
        threading.Thread(target=compile_join, name=name, daemon=True).start()

    @classmethod
    def of(
        cls, sizes: tuple[int, ...], dtype: np.dtype, shape: tuple[int, ...], device: Any
    ) -> _Join:
        # (A forked child compiles its own: the parent's threads do not run in it.)
        key = (sizes, dtype, shape, device, jax.enable_x64.value, os.getpid())
        with cls._lock:
            if key not in cls._made:
                cls._made[key] = cls(sizes, dtype, shape, device)
            return cls._made[key]


@contextlib.contextmanager
def _on(device: Any) -> Iterator[None]:
    """Computations and placements on `device` alone, whatever mesh the caller set
    (`jax.set_mesh`, `jax.sharding.use_abstract_mesh`: the join would otherwise follow it,
    onto every device of the mesh, or fail to lower for an abstract one)."""
    no_mesh = jax.sharding.Mesh(np.empty((), dtype=object), ())
    with (
        jax.set_mesh(no_mesh),
        jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())),
        jax.default_device(device),
    ):
        yield


class _Room:
    """Whether a device has room to join a tensor from its pieces: free memory (where its
    runtime reports it) for the tensor twice (its pieces, then them joined), beyond the
    leaves the restore places on it before that tensor (those it may read in spans, whole
    or not: the plain array leaves of one device). Else the tensor is read whole (once on
    the device)."""

    def __init__(self) -> None:
        self._free: dict[Any, int | None] = {}  # device -> bytes free at the restore's start
        self._placed: dict[Any, int] = {}  # device -> bytes the restore places before

    def to_join(self, device: Any, nbytes: int) -> bool:
        if device not in self._free:
            self._free[device] = _free_bytes(device)
        free = self._free[device]
        return free is None or free - self._placed.get(device, 0) >= 2 * nbytes

    def placed(self, device: Any, nbytes: int) -> None:
        self._placed[device] = self._placed.get(device, 0) + nbytes


def _free_bytes(device: Any) -> int | None:
    """The bytes free on `device`, or None where its runtime keeps no statistics (a CPU)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # a runtime that keeps no statistics
        stats = {}
    if "bytes_limit" not in stats or "bytes_in_use" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats["bytes_in_use"])


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
