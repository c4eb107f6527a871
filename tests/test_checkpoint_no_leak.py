"""Saving again and again holds no more memory, threads or file descriptors than saving a
few times: the short form of `benchmarks/soak.py` (issue 37's no-leak promise), a check
that it catches leaks planted on purpose, and a saved state freed as soon as nobody holds
it."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import os
import platform
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints import CheckpointManager
from eqx_train.checkpoints.manager import _manager

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="counts threads and fds through Linux's /proc"
)

MIB = 2**20
STATE_BYTES = 4 * MIB  # four float32 leaves of 1 MiB
WARM_UP = 20  # saves before the first sample: the compiler, allocator and pools settle
SAVES = 60


def _malloc_trim() -> Callable[[], object]:
    """glibc's `malloc_trim(0)` (malloc hands its free memory back, so that RSS is the
    memory in use, not the free lists' slack); a no-op on another C library."""
    if platform.libc_ver()[0] == "glibc":
        libc = ctypes.CDLL("libc.so.6")
        return lambda: libc.malloc_trim(0)
    return lambda: None


_trim = _malloc_trim()


@dataclasses.dataclass(frozen=True)
class Usage:
    """What the process holds: resident bytes (after a trim), its threads (kernel ids) and
    its open fds (number and what each refers to)."""

    rss: int
    threads: frozenset[int]
    fds: frozenset[tuple[int, str]]


def _open_fds() -> frozenset[tuple[int, str]]:
    listing = os.path.realpath("/proc/self/fd")
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except FileNotFoundError:  # the listing's own fd, closed since
            continue
        if target != listing:
            fds.add((int(name), target))
    return frozenset(fds)


def usage() -> Usage:
    # No gc.collect(): what waits for the garbage collector is held, as in a training loop.
    _trim()
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    threads = frozenset(int(tid) for tid in os.listdir("/proc/self/task"))
    return Usage(rss, threads, _open_fds())


def leaks(before: Usage, after: Usage) -> list[str]:
    """The promise broken between two samples, in words; empty when it holds: RSS within
    2% + 16 MiB, no thread started and no fd opened after the first sample still there at
    the second. (The benchmark, alone in its process, checks that the counts are equal; in
    a test session another test's connections may close meanwhile, so this compares which
    threads and fds are there, not how many.)"""
    found = []
    allowed = before.rss * 0.02 + 16 * MIB
    if after.rss - before.rss > allowed:
        found.append(
            f"RSS grew by {(after.rss - before.rss) / MIB:.1f} MiB (allowed {allowed / MIB:.1f})"
        )
    if started := after.threads - before.threads:
        found.append(f"threads started after the warm-up and still running: {len(started)}")
    if opened := after.fds - before.fds:
        targets = sorted({target for _, target in opened})
        found.append(f"fds opened after the warm-up and still open: {len(opened)} ({targets})")
    return found


@jax.jit
def _step(state: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return jax.tree.map(lambda x: x * 0.5 + 1.0, state)


def soak(directory: Any, saves: int = SAVES) -> tuple[Usage, Usage]:
    """`saves` async saves of a changing 4 MiB state through a `CheckpointManager` that
    keeps 3; the process's usage after save `WARM_UP` and after the last, each sampled once
    that save is written."""
    # Garbage of earlier tests (an executor never shut down, a file never closed) freed
    # during the soak would take its threads or fds away from the count: freed now.
    gc.collect()
    rows = STATE_BYTES // 4 // 4 // 1024
    state = {f"w{i}": jnp.full((rows, 1024), float(i), jnp.float32) for i in range(4)}
    with CheckpointManager(directory, keep_latest=3, async_save=True) as manager:

        def save(steps: range) -> Usage:
            nonlocal state
            for step in steps:
                state = _step(state)
                manager.save(step, state, metrics={"loss": 1.0 / step})
            manager.wait()
            return usage()

        warm = save(range(1, WARM_UP + 1))
        end = save(range(WARM_UP + 1, saves + 1))
        assert manager.all_steps() == [saves - 2, saves - 1, saves]
    return warm, end


def test_sixty_async_saves_hold_no_more_memory_threads_or_fds_than_twenty(tmp_path):
    warm, end = soak(tmp_path / "run")
    assert leaks(warm, end) == []


@pytest.fixture
def no_collector() -> Iterator[None]:
    """The cyclic garbage collector off: a reference cycle inside a save would keep the
    state's buffers (on a GPU, device memory) until the collector next ran."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _state() -> dict[str, jax.Array]:
    return {"w": jnp.arange(MIB, dtype=jnp.float32)}


def test_a_state_saved_by_a_manager_is_freed_once_the_caller_drops_it(tmp_path, no_collector):
    state = _state()
    held = weakref.ref(state["w"])
    with CheckpointManager(tmp_path, async_save=True) as manager:
        manager.save(1, state)
        manager.wait()
        del state
        assert held() is None


def test_a_state_saved_by_save_checkpoint_is_freed_once_the_caller_drops_it(tmp_path, no_collector):
    state = _state()
    held = weakref.ref(state["w"])
    checkpoints.save_checkpoint(tmp_path, state, 1)
    del state
    assert held() is None


# ------------------------------------------------ the check catches what it is there to catch


@pytest.fixture
def plant(monkeypatch) -> Callable[[Callable[[Any], None]], None]:
    """`plant(leak)`: every manager save also calls `leak(state)`, as a leaking save would."""
    original = _manager.save_pipeline

    def install(leak: Callable[[Any], None]) -> None:
        def leaking_save(directory: Any, state: Any, *args: Any, **kwargs: Any) -> str:
            leak(state)
            return original(directory, state, *args, **kwargs)

        monkeypatch.setattr(_manager, "save_pipeline", leaking_save)

    return install


def test_the_check_catches_a_save_that_keeps_every_state_alive(tmp_path, plant):
    kept: list[Any] = []
    plant(kept.append)
    warm, end = soak(tmp_path / "run")
    found = leaks(warm, end)
    assert len(found) == 1 and found[0].startswith("RSS grew by"), found
    # 40 more states of 4 MiB held: 160 MiB, several times the 2% + 16 MiB allowed.
    assert end.rss - warm.rss > 100 * MIB


def test_the_check_catches_a_save_that_leaves_a_thread_running(tmp_path, plant):
    stop = threading.Event()
    plant(lambda _: threading.Thread(target=stop.wait, daemon=True).start())
    try:
        warm, end = soak(tmp_path / "run", saves=WARM_UP + 10)
    finally:
        stop.set()
    assert leaks(warm, end) == ["threads started after the warm-up and still running: 10"]


def test_the_check_catches_a_save_that_leaves_a_file_open(tmp_path, plant):
    opened: list[int] = []
    plant(lambda _: opened.append(os.open(os.devnull, os.O_RDONLY)))
    try:
        warm, end = soak(tmp_path / "run", saves=WARM_UP + 10)
    finally:
        for fd in opened:
            os.close(fd)
    assert leaks(warm, end) == [
        f"fds opened after the warm-up and still open: 10 (['{os.devnull}'])"
    ]


def test_the_check_allows_two_percent_and_16_mib_of_growth_but_not_more():
    before = Usage(rss=500 * MIB, threads=frozenset({1, 2}), fds=frozenset({(3, "a")}))
    assert leaks(before, dataclasses.replace(before, rss=before.rss + 26 * MIB)) == []
    assert leaks(before, dataclasses.replace(before, rss=before.rss + 27 * MIB)) == [
        "RSS grew by 27.0 MiB (allowed 26.0)"
    ]


def test_the_check_ignores_threads_and_fds_that_went_but_not_new_ones():
    before = Usage(rss=500 * MIB, threads=frozenset({1, 2}), fds=frozenset({(3, "a"), (4, "b")}))
    gone = dataclasses.replace(before, threads=frozenset({1}), fds=frozenset({(3, "a")}))
    assert leaks(before, gone) == []
    # fd 4 reused for another file, thread 2 gone and thread 5 started: one of each is new.
    replaced = dataclasses.replace(
        before, threads=frozenset({1, 5}), fds=frozenset({(3, "a"), (4, "c")})
    )
    assert leaks(before, replaced) == [
        "threads started after the warm-up and still running: 1",
        "fds opened after the warm-up and still open: 1 (['c'])",
    ]
