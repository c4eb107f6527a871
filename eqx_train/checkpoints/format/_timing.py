"""Where the save and restore stages spend their time, for the benchmarks.

`stage_times()` collects the seconds each stage was busy (transfers waited for, hashing,
writing, fsync, reading, verifying, placing): stages that overlap add up to more than the
wall time. The format's writer and readers time their own stages, the pipeline the others.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

_stages_lock = threading.Lock()
_stages: dict[str, float] | None = None


@contextlib.contextmanager
def stage_times() -> Iterator[dict[str, float]]:
    """Within this block, every pipeline of the process adds the seconds each of its stages
    was busy to the yielded dict (`"transfer"`, `"hash"`, `"write"`, `"fsync"`, `"read"`,
    `"verify"`, `"place"`). For benchmarks: outside such a block nothing is recorded."""
    global _stages
    times: dict[str, float] = {}
    with _stages_lock:
        _stages = times
    try:
        yield times
    finally:
        with _stages_lock:
            _stages = None


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Adds the time spent in this block to stage `name`, if stages are being timed."""
    if _stages is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        add_stage(name, time.perf_counter() - start)


def add_stage(name: str, seconds: float) -> None:
    with _stages_lock:
        if _stages is not None:
            _stages[name] = _stages.get(name, 0.0) + seconds


def timing() -> bool:
    return _stages is not None
