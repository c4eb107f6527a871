"""Soak: a thousand async saves through a `CheckpointManager` leak no memory, threads or fds.

A training loop's state (16 MiB of float32 as 4 leaves, on the default device or the one
`--device` names) changes before every save, as a step changes it, and is saved with
`CheckpointManager(async_save=True, keep_latest=3)`: every save writes a new file and
retention deletes one. After the saves named by `--marks` (default 1, 10, 100, 200, ...,
1000) the loop waits for the save in flight and samples the process: resident memory
(RSS) as the system reports it and again after glibc's `malloc_trim(0)` (malloc's free
lists handed back; never a `gc.collect()`, so garbage waiting for the collector counts),
threads (the kernel's count, which includes the runtime's own pools, and Python's), open
file descriptors, and, on an accelerator, the device memory in use.

The promise (issue 37): from save 100 to the last, the trimmed RSS (the raw one where the C
library is not glibc) grows by at most 2% + 16 MiB, and the thread and descriptor counts
are equal. The first 100 saves are the warm-up: the compiler, the allocator, the thread
pools and the store's connection pool settle. The highest sample after the warm-up and the
raw RSS are printed beside the verdict: held garbage freed now and then makes a sawtooth
that the two ends can miss (docs/benchmarks.md shows one).
`--storage s3` runs the same loop against SeaweedFS on 127.0.0.1 (started here, as the
tests start it). Exits with status 1 if the promise is broken.

    python benchmarks/soak.py [--saves 1000] [--state-mib 16] [--keep 3] \
        [--storage local s3] [--device gpu] [--dir DIR]

Prints a table per storage and a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _timing import print_table, rss_bytes  # noqa: E402

from eqx_train.checkpoints import CheckpointManager  # noqa: E402

MIB = 2**20
LEAVES = 4
WARM_UP = 100  # the save whose sample the last one is compared with


def _malloc_trim() -> Callable[[], object] | None:
    """glibc's `malloc_trim(0)`, which hands the free memory malloc keeps back to the
    system; None on another C library."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return functools.partial(ctypes.CDLL("libc.so.6").malloc_trim, 0)
    except (OSError, AttributeError):
        return None


MALLOC_TRIM = _malloc_trim()


@dataclasses.dataclass(frozen=True)
class Sample:
    """The process after a save: resident bytes as the system sees them and once malloc
    has handed back its free memory (None without glibc), kernel threads, Python threads,
    open fds, the device's bytes in use (None where the platform does not say)."""

    saves: int
    seconds: float
    rss: int
    rss_trimmed: int | None
    threads: int
    python_threads: int
    fds: int
    device_bytes: int | None


def sample(saves: int, seconds: float, device: Any) -> Sample:
    stats = device.memory_stats()
    rss = rss_bytes()
    if MALLOC_TRIM is not None:
        MALLOC_TRIM()  # no gc.collect(): garbage waiting for the collector counts as held
    return Sample(
        saves=saves,
        seconds=seconds,
        rss=rss,
        rss_trimmed=None if MALLOC_TRIM is None else rss_bytes(),
        threads=len(os.listdir("/proc/self/task")),
        python_threads=threading.active_count(),
        fds=len(os.listdir("/proc/self/fd")),
        device_bytes=None if stats is None else stats.get("bytes_in_use"),
    )


def make_state(state_mib: int, device: Any) -> dict[str, jax.Array]:
    rows = state_mib * MIB // 4 // LEAVES // 1024
    rng = np.random.default_rng(0)
    host = {f"layer_{i}": rng.standard_normal((rows, 1024), np.float32) for i in range(LEAVES)}
    return jax.device_put(host, device)


@jax.jit
def train_step(state: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """New buffers with new values, as an optimiser step makes them."""
    return jax.tree.map(lambda x: x * jnp.float32(0.999) + jnp.float32(0.001), state)


def soak(
    directory: str,
    state: dict[str, jax.Array],
    *,
    saves: int,
    keep: int,
    marks: list[int],
    storage_options: dict[str, Any] | None = None,
) -> list[Sample]:
    """`saves` async saves of a changing `state` through one manager; a sample after each
    save in `marks`, taken once that save is durable."""
    device = next(iter(jax.tree.leaves(state)[0].devices()))
    samples = []
    start = time.perf_counter()
    with CheckpointManager(
        directory, keep_latest=keep, async_save=True, storage_options=storage_options
    ) as manager:
        for step in range(1, saves + 1):
            state = train_step(state)
            manager.save(step, state, metrics={"loss": 1.0 / step})
            if step in marks:
                manager.wait()
                samples.append(sample(step, time.perf_counter() - start, device))
        kept = manager.all_steps()
    if kept != list(range(saves - keep + 1, saves + 1)):
        raise RuntimeError(f"soak: retention kept steps {kept}, expected the last {keep}")
    return samples


def verdict(samples: list[Sample], state_bytes: int) -> dict[str, Any]:
    """The promise checked between the sample at `WARM_UP` saves (or the first) and the
    last: resident memory within 2% + one state's bytes (after a trim where there is one:
    malloc's free lists wander by a few states' bytes from sample to sample, see
    docs/benchmarks.md), threads and fds equal. The raw RSS is reported beside it."""
    warm = next((s for s in samples if s.saves >= WARM_UP), samples[0])
    last = samples[-1]
    trimmed = warm.rss_trimmed is not None and last.rss_trimmed is not None
    before, after = (
        (warm.rss_trimmed or 0, last.rss_trimmed or 0) if trimmed else (warm.rss, last.rss)
    )
    allowed = int(before * 0.02) + state_bytes
    after_warm_up = [s for s in samples if s.saves >= warm.saves]
    peak = max((s.rss_trimmed or 0) if trimmed else s.rss for s in after_warm_up)
    raw = [s.rss for s in after_warm_up]
    return {
        "from_save": warm.saves,
        "to_save": last.saves,
        "measured": "rss_after_malloc_trim" if trimmed else "rss",
        "growth_mib": round((after - before) / MIB, 1),
        "allowed_mib": round(allowed / MIB, 1),
        # Garbage freed now and then by the collector makes a sawtooth that the two ends
        # can miss (the collector may just have run): the highest sample is reported too.
        "peak_growth_mib": round((peak - before) / MIB, 1),
        "raw_rss_growth_mib": round((last.rss - warm.rss) / MIB, 1),
        "raw_rss_range_mib": [round(min(raw) / MIB), round(max(raw) / MIB)],
        "threads": [warm.threads, last.threads],
        "fds": [warm.fds, last.fds],
        "holds": after - before <= allowed
        and warm.threads == last.threads
        and warm.fds == last.fds,
    }


def print_samples(title: str, samples: list[Sample]) -> None:
    device = any(s.device_bytes is not None for s in samples)
    rows = []
    for s in samples:
        row = [
            str(s.saves),
            f"{s.seconds:7.1f}",
            f"{s.rss / MIB:8.1f}",
            "-" if s.rss_trimmed is None else f"{s.rss_trimmed / MIB:8.1f}",
            str(s.threads),
            str(s.python_threads),
            str(s.fds),
        ]
        if device:
            row.append("-" if s.device_bytes is None else f"{s.device_bytes / MIB:8.1f}")
        rows.append(row)
    header = ["saves", "elapsed s", "RSS MiB", "trimmed MiB", "threads", "py threads", "fds"]
    print_table(title, header + (["device MiB"] if device else []), rows)


@contextmanager
def local_location(base: str | None) -> Iterator[tuple[str, dict[str, Any] | None]]:
    directory = tempfile.mkdtemp(prefix="eqx_train_soak_", dir=base)
    try:
        yield os.path.join(directory, "run"), None
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextmanager
def s3_location(base: str | None) -> Iterator[tuple[str, dict[str, Any] | None]]:
    from tests.support.s3_server import SeaweedS3

    data = tempfile.mkdtemp(prefix="eqx_train_soak_s3_", dir=base)
    server = SeaweedS3(data).start()
    try:
        yield f"{server.create_bucket(f'soak-{os.getpid()}')}/run", server.storage_options
    finally:
        server.stop(remove=True)
        shutil.rmtree(data, ignore_errors=True)


LOCATIONS: dict[str, Callable[[str | None], Any]] = {"local": local_location, "s3": s3_location}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--saves", type=int, default=1000)
    parser.add_argument("--state-mib", type=int, default=16)
    parser.add_argument("--keep", type=int, default=3, help="keep_latest of the manager")
    parser.add_argument("--storage", nargs="+", choices=sorted(LOCATIONS), default=["local"])
    parser.add_argument("--device", default=None, help="a JAX backend (default: the default)")
    parser.add_argument("--marks", type=int, nargs="+", default=None, help="saves to sample at")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    marks = args.marks or sorted({1, 10, *range(100, args.saves + 1, 100), args.saves})
    device = jax.devices(args.device)[0]
    summary: dict[str, Any] = {
        "platform": device.platform,
        "device": device.device_kind,
        "saves": args.saves,
        "state_mib": args.state_mib,
        "keep": args.keep,
    }
    holds = True
    for storage in args.storage:
        state = make_state(args.state_mib, device)
        state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
        with LOCATIONS[storage](args.dir) as (directory, options):
            samples = soak(
                directory,
                state,
                saves=args.saves,
                keep=args.keep,
                marks=marks,
                storage_options=options,
            )
        del state
        print_samples(
            f"{args.saves} async saves of {state_bytes / MIB:.0f} MiB ({LEAVES} float32 "
            f"leaves) to {storage}, keep_latest={args.keep}, on {device.platform} "
            f"({device.device_kind})",
            samples,
        )
        result = verdict(samples, state_bytes)
        holds = holds and result["holds"]
        print(
            f"{storage}: {result['measured']} {result['growth_mib']:+.1f} MiB from save "
            f"{result['from_save']} to {result['to_save']} (allowed "
            f"{result['allowed_mib']:.1f}; highest sample {result['peak_growth_mib']:+.1f}; "
            f"raw RSS {result['raw_rss_growth_mib']:+.1f}, "
            f"between {result['raw_rss_range_mib'][0]} and {result['raw_rss_range_mib'][1]}"
            f" MiB); threads {result['threads']}; fds {result['fds']}: "
            f"{'holds' if result['holds'] else 'BROKEN'}"
        )
        summary[storage] = {
            **result,
            "seconds_per_save": round(samples[-1].seconds / args.saves, 4),
            "rss_mib": {s.saves: round(s.rss / MIB, 1) for s in samples},
            "rss_trimmed_mib": {
                s.saves: None if s.rss_trimmed is None else round(s.rss_trimmed / MIB, 1)
                for s in samples
            },
        }
    print(json.dumps({"benchmark": "soak", **summary}))
    sys.exit(0 if holds else 1)


if __name__ == "__main__":
    main()
