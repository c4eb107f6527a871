"""Reading the tensors of a local file with several threads at once.

One thread copies a file out of the page cache (or a RAM disk) at a few GiB/s; a server's
memory moves several times that, but only with several copies in flight. So the tensors a
restore reads together go to a pool of `READERS` threads that every read of the process
shares (the concurrent groups of a restore then keep about `READERS` reads in flight
between them): a tensor of at most `SPLIT_BYTES` whole, hashed chunk by chunk right after
each chunk is read, while it is still in cache; a larger one in parts read at once. A
tensor checksummed in parts (format version 3, `_checksums`) is cut along its parts, each
verified by the thread that reads it, chunk by chunk as it reads, so that one tensor
verifies on every reader at once. An older file's one digest per tensor is a single
stream: the calling thread computes it over parts of `PART_BYTES`, in order, as they
arrive (at one core's speed, which bounds such a tensor's restore). Only a tensor in memory
is cut, though: one still on the disk (the source says, `LocalSource.cached`) is read
whole, front to back, the order a disk's readahead serves fastest. A span of a tensor's
parts (`_spans.Span`: a restore onto an accelerator reads a tensor larger than a quarter of
its window, or of its pinned arena, span by span) is read as the parts of a tensor are,
each verified against its own part's digest, in order by one reader where it is on the
disk.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from ._checksums import Parts, verify_bytes, verify_part, verify_parts
from ._spans import Span, describe
from ._timing import add_stage, timing

PART_BYTES = 8 << 20
_CORES = os.cpu_count() or 1
# Reads in flight at once in the process: beyond about 8 a server's memory bandwidth, not
# the number of copies, bounds a read out of the page cache.
READERS = max(4, min(8, _CORES))
# Tensors larger than this are cut into parts read at once. With cores to spare, any of more
# than two parts. On a few cores only those a restore's window reads (nearly) alone: where
# several groups are in flight their readers already keep the cores busy, and parts only
# add a pass over memory (a part is hashed after it is read, no longer in cache).
SPLIT_BYTES = 2 * PART_BYTES if _CORES > 4 else 128 << 20

_pool_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (the process id that made it, pool)


def _readers() -> ThreadPoolExecutor:
    """The process's pool of reading threads, made on first use (again in a forked child:
    a pool's threads do not survive a fork, and one inherited would never run a read)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            pool = ThreadPoolExecutor(READERS, thread_name_prefix="eqx_train-read")
            _pool = (os.getpid(), pool)
        return _pool[1]


def split(
    view: memoryview, offset: int, part_bytes: int | None = None
) -> list[tuple[memoryview, int]]:
    """`view` (the bytes from file offset `offset` on) as consecutive parts of at most
    `part_bytes` (default `PART_BYTES`) each: (the part's bytes, its file offset)."""
    size = PART_BYTES if part_bytes is None else part_bytes
    return [(view[i : i + size], offset + i) for i in range(0, len(view), size)]


def spans(info: Any, max_bytes: int) -> list[Span] | None:
    """Tensor `info` as consecutive spans of its parts, each of whole elements and of at most
    `max_bytes`, but at least the fewest parts that end on an element (one, unless a
    crafted part size splits elements); None where it has no parts (a file before format
    version 3, a tensor of one part) or would be one span."""
    if not isinstance(info.checksum, Parts):
        return None
    size, itemsize = info.checksum.size, info.dtype.itemsize
    whole_elements = itemsize // math.gcd(size, itemsize)  # parts that end on an element
    per_span = max(1, max_bytes // size // whole_elements) * whole_elements
    count = len(info.checksum.digests)
    if count <= per_span:
        return None
    return [
        Span(info.name, i, min(i + per_span, count), min(per_span * size, info.nbytes - i * size))
        for i in range(0, count, per_span)
    ]


def span_shape(info: Any, span: Span) -> tuple[int]:
    """The shape `span` of tensor `info` is read as (flat); raises `ValueError` for a span
    that is not one of its parts, or not `span.nbytes` of whole elements."""
    parts = info.checksum
    if not isinstance(parts, Parts) or not 0 <= span.first < span.stop <= len(parts.digests):
        raise ValueError(f"{describe(span)} is not a span of the tensor's parts")
    start, stop = span.first * parts.size, min(span.stop * parts.size, info.nbytes)
    itemsize = info.dtype.itemsize
    if start % itemsize or stop % itemsize or span.nbytes != stop - start:
        raise ValueError(f"{describe(span)} is not {span.nbytes} bytes of whole {info.dtype}")
    return ((stop - start) // itemsize,)


def span_offset(info: Any, first: int | None) -> int:
    """The file offset of part `first` of tensor `info` (None: of the tensor itself)."""
    parts = info.checksum
    return info.start + (first * parts.size if first and isinstance(parts, Parts) else 0)


def read_tensors(
    fill: Callable[[Any, np.ndarray, bool], None],
    read_into: Callable[[memoryview, int], None],
    jobs: Sequence[tuple[Any, np.ndarray, memoryview, int | None]],
    verify: bool,
    bad: Callable[[str], Exception],
    cached: Callable[[int, int], bool] | None = None,
) -> None:
    """Fills each job's buffer (tensor info, its buffer, the buffer's bytes, and None for a
    whole tensor or the index of the first part of a span of one) on the shared readers:
    a tensor of at most `SPLIT_BYTES` whole, by `fill(info, buffer, verify)` (which hashes
    each chunk right after reading it); a larger one, or a span, part by part, with
    `read_into(part, file offset)`, checked (with `verify`, where it has a checksum) by
    the reader of each part where it has a digest per part, else on this thread as its
    parts arrive, raising `bad(...)` if it fails. Where `cached(file offset, bytes)` says
    the bytes are not in memory, a tensor is read whole and a span's parts in order, by
    one reader (a disk serves one stream front to back faster than scattered parts).
    Returns, or raises, only once no reader writes into any of the buffers."""
    timed = timing()

    def read(part: memoryview, offset: int) -> None:
        start = time.perf_counter() if timed else 0.0
        read_into(part, offset)
        if timed:
            add_stage("read", time.perf_counter() - start)

    def read_part(info: Any, index: int, part: memoryview, offset: int) -> None:
        if verify and isinstance(info.checksum, Parts):
            read_while_hashing(
                read_into, offset, lambda each: verify_part(info, index, part, bad, each)
            )
        else:
            read(part, offset)

    def read_in_order(info: Any, first: int, parts: list[tuple[memoryview, int]]) -> None:
        for index, (part, offset) in enumerate(parts, first):
            read_part(info, index, part, offset)

    pool = _readers()
    futures: list[list[Future[Any]]] = []
    cut: list[list[tuple[memoryview, int]] | None] = []
    try:
        for info, out, view, first in jobs:
            # Each read recorded as soon as it is submitted: a submit that fails, or an
            # interrupt between two, must not leave a read the `finally` does not wait for.
            pending: list[Future[Any]] = []
            futures.append(pending)
            has_parts = isinstance(info.checksum, Parts)
            size = info.checksum.size if has_parts and (verify or first is not None) else None
            offset = span_offset(info, first)
            large = first is not None or info.nbytes > max(SPLIT_BYTES, size or 0)
            # Asked only of a tensor that may be cut (two reads that refuse to wait, each).
            in_memory = large and (cached is None or cached(offset, len(view)))
            if first is None and not in_memory:
                cut.append(None)
                pending.append(pool.submit(fill, info, out, verify))
                continue
            parts = split(view, offset, size)
            cut.append(parts)
            if in_memory:
                for index, (part, at) in enumerate(parts, first or 0):
                    pending.append(pool.submit(read_part, info, index, part, at))
            else:
                pending.append(pool.submit(read_in_order, info, first or 0, parts))
        for (info, _, _, _), parts, pending in zip(jobs, cut, futures, strict=True):
            if parts is not None and verify and isinstance(info.checksum, str):
                arrived = _Arrivals(parts, pending)
                start = time.perf_counter()
                verify_parts(info, arrived, bad)
                if timed:
                    add_stage("verify", time.perf_counter() - start - arrived.waited)
            else:
                for future in pending:
                    future.result()
    finally:
        # On an error (or an interrupt of this thread), the reads not yet started are
        # dropped and those running finish before the caller lets the buffers go.
        stop_and_wait([future for job in futures for future in job])


def read_while_hashing(
    read_into: Callable[[memoryview, int], None],
    offset: int,
    hash_with: Callable[[Callable[[memoryview], None]], None],
) -> None:
    """Runs `hash_with(each)` (a checksum over a buffer, chunk by chunk), where `each(chunk)`
    reads the chunk's bytes (the next ones from file `offset` on) with `read_into` just
    before it is hashed, so that each is hashed while still in cache; the time spent
    reading and hashing goes to the stage breakdown."""
    reading, start = 0.0, time.perf_counter()

    def read_chunk(chunk: memoryview) -> None:
        nonlocal offset, reading
        began = time.perf_counter()
        read_into(chunk, offset)
        reading += time.perf_counter() - began
        offset += len(chunk)

    hash_with(read_chunk)
    if timing():  # reads and hashes alternate chunk by chunk
        add_stage("read", reading)
        add_stage("verify", time.perf_counter() - start - reading)


def verify_tensors(
    jobs: Sequence[tuple[Any, memoryview, int | None]],
    bad: Callable[[str], Exception],
    parallel: bool = True,
) -> None:
    """Checks the bytes already read of each job's tensor (its info, its bytes, and None
    for the whole tensor or the index of the first part of a span of it) against its
    checksum: a tensor checksummed in parts part by part, on the shared readers at once
    (with `parallel`; else on this thread), any other whole. A restore onto an
    accelerator checks a group this way while the group's transfers to its devices run,
    rather than before they start. Raises `bad(...)` for the first tensor (in order) that
    fails; returns, or raises, only once no reader reads any of the bytes."""
    timed = timing()

    def timed_check(check: Callable[..., None], *args: Any) -> None:
        start = time.perf_counter() if timed else 0.0
        check(*args)
        if timed:
            add_stage("verify", time.perf_counter() - start)

    checks: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
    for info, view, first in jobs:
        if not info.checksum:
            continue
        if isinstance(info.checksum, Parts) and (
            first is not None or info.nbytes > info.checksum.size
        ):
            parts = split(view, 0, info.checksum.size)
            for index, (part, _) in enumerate(parts, first or 0):
                checks.append((verify_part, (info, index, part, bad)))
        else:
            checks.append((verify_bytes, (info, view, bad)))
    if not parallel:
        for check, args in checks:
            timed_check(check, *args)
        return
    pool = _readers()
    futures: list[Future[Any]] = []
    try:
        for check, args in checks:
            futures.append(pool.submit(timed_check, check, *args))
        for future in futures:
            future.result()
    finally:
        stop_and_wait(futures)


def stop_and_wait(futures: Sequence[Future[Any]]) -> None:
    """Cancels the `futures` not yet started and waits (through interrupts) for the rest."""
    for future in futures:
        future.cancel()
    wait_through_interrupts(lambda: wait_started(futures))


def wait_started(futures: Sequence[Future[Any]]) -> None:
    """Waits for every future of `futures` that was not cancelled. A future cancelled
    before it started never runs, and `concurrent.futures.wait` may never see it end: it
    counts one as done only once a worker has dequeued it, which a pool shut down with
    `cancel_futures=True` never does."""
    wait([future for future in futures if not future.cancelled()])


def wait_through_interrupts(wait_for: Callable[[], Any]) -> None:
    """Runs `wait_for` (a wait for threads that write into buffers about to be let go) to
    its end, even through interrupts: a second Ctrl-C while an interrupted read cleans up
    must not free a buffer a thread still writes into (a reused pinned block would then
    take an old read's bytes after its own were verified). The last interrupt is raised
    once the wait is over."""
    interrupt: BaseException | None = None
    while True:
        try:
            wait_for()
            break
        except (KeyboardInterrupt, SystemExit) as error:
            interrupt = error
    if interrupt is not None:
        raise interrupt


class _Arrivals:
    """The parts of one tensor in order, each yielded once its read is done (its error
    raised then); `waited` is the seconds spent waiting for reads, not hashing."""

    def __init__(self, job: list[tuple[memoryview, int]], pending: list[Future[Any]]):
        self.job, self.pending, self.waited = job, pending, 0.0

    def __iter__(self) -> Iterator[memoryview]:
        for (part, _), future in zip(self.job, self.pending, strict=True):
            start = time.perf_counter()
            future.result()
            self.waited += time.perf_counter() - start
            yield part
