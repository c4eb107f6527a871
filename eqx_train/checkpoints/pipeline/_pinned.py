"""Pinned host buffers that a restore onto an accelerator reads its tensors into.

A host-to-device copy from ordinary (pageable) memory cannot be a DMA: the runtime first
copies the bytes into a pinned staging buffer on the calling thread, allocating it (slowly,
for large ones) each time, so a restore from the page cache spends most of its time in
that second copy. Memory the runtime has DMA-mapped (`Client.dma_map`) skips it: the
device reads it directly, at the interconnect's speed.

So each accelerator client gets one `Arena`: `ARENA_BYTES` of page-aligned host memory,
DMA-mapped once, on its first restore, and reused by every restore after it. A restore
reads a tensor straight into a block of it (`_read.read_whole` offers the blocks through
`FileReader.read_many(into=...)`), places it from there, and frees the block once the
tensor is on its device. A tensor the arena has no room for gets a buffer of its own, as
before. A platform whose runtime has no DMA mapping (a CPU, whose devices adopt host
buffers without any copy) gets no arena.

The arena is held for the life of the process (that is the point: pinning memory costs
more than copying it once); `release()` unmaps and frees every arena nobody is using.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import jax
else:  # imported on first use: the command line reads headers without JAX
    from ..._lazy import LazyModule

    jax = LazyModule("jax")

ARENA_BYTES = 256 << 20  # the default host window: a restore holds no more at once
_BLOCK_ALIGN = 4096  # every block starts on a page, as a tensor of a file does


class Arena:
    """A DMA-mapped host buffer of `nbytes`, handed out in page-aligned blocks (first fit;
    freed blocks merge with their free neighbours). Thread-safe."""

    def __init__(self, nbytes: int, dma_map: Any) -> None:
        self.nbytes = nbytes
        raw = np.empty(nbytes + _BLOCK_ALIGN, np.uint8)
        start = -raw.ctypes.data % _BLOCK_ALIGN
        self.buffer = raw[start : start + nbytes]
        self.address = self.buffer.ctypes.data
        dma_map(self.address, nbytes)
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (start, size), by start
        self._used: dict[int, int] = {}  # start -> size
        self._closed = False  # released: hands out nothing more

    def allocate(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        """A C-contiguous array of `shape` and `dtype` in the arena, or None when no free
        block is large enough (or the array is empty: nothing to transfer; or the arena was
        released meanwhile)."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes == 0:
            return None
        size = -(-nbytes // _BLOCK_ALIGN) * _BLOCK_ALIGN
        with self._lock:
            if self._closed:
                return None
            for i, (start, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[i]
                    else:
                        self._free[i] = (start + size, free - size)
                    self._used[start] = size
                    break
            else:
                return None
        return self.buffer[start : start + nbytes].view(dtype).reshape(shape)

    def owns(self, array: np.ndarray) -> bool:
        offset = array.ctypes.data - self.address
        return 0 <= offset < self.nbytes

    def free(self, array: np.ndarray) -> None:
        """Gives the block of `array` (an array `allocate` returned) back."""
        start = array.ctypes.data - self.address
        with self._lock:
            size = self._used.pop(start)
            self._free.append((start, size))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for begin, length in self._free:
                if merged and merged[-1][0] + merged[-1][1] == begin:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((begin, length))
            self._free = merged

    def in_use(self) -> int:
        """Bytes handed out and not yet freed."""
        with self._lock:
            return sum(self._used.values())

    def close_if_unused(self) -> bool:
        """Closes the arena (no block is handed out after) if no block is in use, at once
        with that check: a restore that got the arena just before cannot take a block of
        memory about to be unmapped. Whether it closed."""
        with self._lock:
            self._closed = self._closed or not self._used
            return self._closed


_lock = threading.Lock()
_arenas: dict[int, tuple[Any, Arena | None]] = {}  # id(client) -> (client, its arena or None)


def dma_map(client: Any, address: int, nbytes: int) -> None:
    """DMA-maps host memory for `client` (raises where its runtime cannot)."""
    client.dma_map(address, nbytes)


def eligible(platform: str) -> bool:
    """Whether a device of `platform` copies host bytes at all (a CPU device adopts them)."""
    return platform != "cpu"


def arena_for(device: Any) -> Arena | None:
    """The arena of `device`'s client, made (and DMA-mapped) on first use; None for a
    platform without DMA mapping, or one whose runtime refused it (remembered)."""
    if not eligible(device.platform):
        return None
    client = device.client
    with _lock:
        if id(client) not in _arenas:
            try:
                arena: Arena | None = Arena(ARENA_BYTES, lambda a, n: dma_map(client, a, n))
            except Exception:  # no DMA mapping here (an unimplemented platform, a limit)
                arena = None
            _arenas[id(client)] = (client, arena)  # the client held: its id stays its own
        return _arenas[id(client)][1]


def target_device(leaf: Any) -> Any | None:
    """A device a target array `leaf` (a `jax.Array` or `jax.ShapeDtypeStruct`) is placed
    on (the devices of one process share one client), else None: not an array target, or
    one placed in host memory (`memory_kind` `pinned_host`, `unpinned_host`), which may
    keep the very buffer it is placed from rather than copy it."""
    if isinstance(leaf, np.ndarray) or not isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
        return None
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None:
        if getattr(sharding, "memory_kind", None) not in (None, "device"):
            return None
        return next(iter(sharding.device_set))
    device = jax.default_device.value  # where `device_put` places a leaf without one
    if device is None:
        return jax.devices()[0]
    return jax.devices(device)[0] if isinstance(device, str) else device


def release() -> None:
    """Unmaps and frees every arena with no block in use (a later restore makes it again)."""
    with _lock:
        for key, (client, arena) in list(_arenas.items()):
            if arena is not None and arena.close_if_unused():
                try:
                    client.dma_unmap(arena.address)
                except Exception:  # the mapping went with the client
                    pass
                del _arenas[key]
            elif arena is None:
                del _arenas[key]
