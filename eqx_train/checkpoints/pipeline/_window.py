"""The host window: how many leaf bytes the save and restore pipelines hold on the host
(and, re-exported from `format._timing`, where their stages spend their time).

`HostWindow` counts the bytes one pipeline holds; `held_bytes()` / `peak_held_bytes()` sum
them over every pipeline of the process (they are what the memory tests measure: on a CPU
backend, process RSS also counts device memory and the allocator's caches).

`stage_times()` collects, for the benchmarks, the seconds each stage of a pipeline was busy
(`format._timing`).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..._calls import call
from ..format._timing import (
    add_stage as add_stage,
    stage as stage,
    stage_times as stage_times,
    timing as timing,
)

DEFAULT_HOST_WINDOW_BYTES = 256 << 20


def check_window(host_window_bytes: Any) -> None:
    """Refuses a `host_window_bytes` that is not a positive int, naming it."""
    if (
        not isinstance(host_window_bytes, int | np.integer)
        or isinstance(host_window_bytes, bool)
        or host_window_bytes < 1
    ):
        raise ValueError(
            f"{call()}: host_window_bytes must be a positive int (bytes), got "
            f"{host_window_bytes!r}."
        )


_stats_lock = threading.Lock()
_held = 0
_peak = 0


def held_bytes() -> int:
    """Leaf bytes every pipeline of this process holds on the host right now."""
    return _held


def peak_held_bytes() -> int:
    """The most leaf bytes the pipelines held at once since `reset_peak()`."""
    return _peak


def reset_peak() -> None:
    global _peak
    with _stats_lock:
        _peak = _held


def _count(delta: int) -> None:
    global _held, _peak
    with _stats_lock:
        _held += delta
        _peak = max(_peak, _held)


_window_limit: contextvars.ContextVar[int] = contextvars.ContextVar(
    "eqx_train_host_window_bytes", default=DEFAULT_HOST_WINDOW_BYTES
)


@contextlib.contextmanager
def host_window_bytes(limit: int) -> Iterator[None]:
    """Within this block (in this thread), the writer's window holds `limit` bytes: a save
    sets it around its commit, so the writer keeps its three-argument call."""
    token = _window_limit.set(limit)
    try:
        yield
    finally:
        _window_limit.reset(token)


def current_window() -> HostWindow:
    return HostWindow(_window_limit.get())


class Cancelled(Exception):
    """Raised by `HostWindow.acquire` once the window is cancelled: its pipeline is over."""


class HostWindow:
    """Admits leaf bytes up to `limit` at once (a leaf bigger than `limit` alone), blocking
    `acquire` until enough earlier bytes are released. Thread-safe: a restore's reader
    thread acquires while the caller's thread releases each group once it is placed.

    One window belongs to one pipeline, so what it holds when the pipeline ends is exactly
    what the pipeline failed to release: `cancel()` wakes every waiting `acquire` (which then
    raises `Cancelled`), and `release_all()` lets the rest go, wherever an interrupt left it.
    """

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.in_use = 0
        self.cancelled = False
        self._free = threading.Condition()

    def fits(self, nbytes: int) -> bool:
        return self.in_use == 0 or self.in_use + nbytes <= self.limit

    def acquire(self, nbytes: int) -> None:
        with self._free:
            self._free.wait_for(lambda: self.cancelled or self.fits(nbytes))
            if self.cancelled:
                raise Cancelled
            self.in_use += nbytes
            _count(nbytes)

    def release(self, nbytes: int) -> None:
        with self._free:
            nbytes = min(nbytes, self.in_use)  # never below zero after a `release_all`
            self.in_use -= nbytes
            _count(-nbytes)
            self._free.notify_all()

    def cancel(self) -> None:
        with self._free:
            self.cancelled = True
            self._free.notify_all()

    def release_all(self) -> None:
        self.release(self.in_use)
