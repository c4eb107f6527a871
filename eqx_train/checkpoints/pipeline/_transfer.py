"""Moving leaf bytes between devices and the host, a bounded window at a time.

A save moves leaves to the host a few at a time, in order, starting the transfers of the
next leaves (into pinned host memory, several in flight) before the writer consumes the
current one, and lets each leaf's host bytes go once they are written (`host_arrays`); a
restore reads, verifies and places several groups of leaves at once in background threads
while the caller waits for the previous group to reach its devices (`windowed_reads`). At
most the window's bytes are held at once (`_window.HostWindow`), and always at least one leaf.

An interrupt (`KeyboardInterrupt`, or a `SystemExit` from a signal handler) stops either
pipeline wherever it lands: the window is cancelled, which wakes a reader thread waiting
for room, and every byte the pipeline still holds is released.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Hashable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from threading import Lock
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ..._calls import call, in_context
from ..format._part_reads import wait_started, wait_through_interrupts
from ._window import Cancelled, HostWindow, add_stage, current_window, timing

# A restore reads up to this many groups of leaves at once, each a share of the window.
GROUPS_PER_WINDOW = 4
K = TypeVar("K", bound=Hashable)  # what `windowed_reads` reads: a tensor's name, a span

if TYPE_CHECKING:
    import jax

    from ..format._description import Tensor
else:  # imported on first use: the command line reads headers without JAX
    from ..._lazy import LazyModule

    jax = LazyModule("jax")


class Pins:
    """The shards of an array on CPU devices, held in place: NumPy views that share its
    buffers and keep every replica from being donated while they live. Called, it gives
    the array's whole value (its one shard's view as it is, else the first replica of each
    shard copied into place); `release()` lets the buffers go once the value is written."""

    def __init__(self, array: jax.Array) -> None:
        self.shape, self.dtype = tuple(array.shape), np.dtype(array.dtype)
        self.views: list[tuple[Any, int, np.ndarray]] | None
        if len(array.sharding.device_set) == 1:
            # Directly: some JAX versions keep every `shard.data` made alive with the array.
            self.views = [(tuple(slice(0, d) for d in array.shape), 0, np.asarray(array))]
        else:
            self.views = [
                (shard.index, shard.replica_id, np.asarray(shard.data))
                for shard in array.addressable_shards
            ]

    def __call__(self) -> np.ndarray:
        if self.views is None:
            raise RuntimeError("the pinned buffers were released before being read")
        if len(self.views) == 1:
            return self.views[0][2]
        value = np.empty(self.shape, self.dtype)
        for index, replica, view in self.views:
            if replica == 0:
                value[index] = view
        return value

    def release(self) -> None:
        self.views = None


# --------------------------------------------------------------------------------------------
# Device -> host, a window at a time.


_pinned_refused: set[str] = set()  # platforms whose runtime refused a pinned_host transfer


def reads_in_place(platform: str) -> bool:
    """Whether a device's bytes are read where they are: a CPU device's memory is host
    memory, so no transfer is needed."""
    return platform == "cpu"


def _start_transfer(source: jax.Array) -> tuple[Any, bool]:
    """Starts moving `source` to host memory: (what `np.asarray` turns into the host value,
    whether that value is a copy independent of `source`'s buffers).

    A CPU device's memory is host memory: its bytes are read in place. Elsewhere the array
    (one replica of it, when it is replicated) goes to pinned host memory, which the runtime
    pools and reuses from save to save, asynchronously: several transfers are in flight
    while the writer hashes and writes earlier leaves.
    """
    platform = next(iter(source.sharding.device_set)).platform
    if reads_in_place(platform):
        return source, False
    if source.is_fully_replicated and len(source.sharding.device_set) > 1:
        source = source.addressable_shards[0].data
    if platform not in _pinned_refused:
        try:
            return jax.device_put(source, source.sharding.with_memory_kind("pinned_host")), True
        except Exception:  # a runtime without host memory kinds: pageable copies then
            _pinned_refused.add(platform)
    source.copy_to_host_async()
    return source, True


def _held_for(tensor: Tensor) -> int:
    """Host bytes a leaf takes while the pipeline holds it: twice its size when its shards
    arrive separately and are assembled into one array on the host."""
    nbytes = tensor.nbytes
    source = tensor.source
    if (
        isinstance(source, jax.Array)
        and len(source.sharding.device_set) > 1
        and not source.is_fully_replicated
        and not reads_in_place(next(iter(source.sharding.device_set)).platform)
    ):
        return 2 * nbytes
    return nbytes


def host_arrays(
    tensors: Sequence[Tensor], window: HostWindow, *, final: bool = True
) -> Generator[tuple[Tensor, np.ndarray], None, None]:
    """Each tensor with its value as a host NumPy array, in order, holding at most
    `window`'s bytes.

    Before yielding a leaf, transfers of the following leaves are started while they fit in
    the window. A yielded array is valid until the next one is asked for; then its bytes
    count as released. On the `final` pass over a snapshot (`Tensor.owned`), each leaf's
    device copy is freed as soon as its bytes are on the host. Closing the generator early
    releases everything it holds.
    """
    started: deque[tuple[int, Any, bool, int]] = deque()  # (index, handle, separate, bytes)
    following = 0

    def start_more() -> None:
        nonlocal following
        while following < len(tensors):
            tensor = tensors[following]
            nbytes = _held_for(tensor)
            if not window.fits(nbytes):
                return
            window.acquire(nbytes)
            handle, separate = None, False
            if isinstance(tensor.source, jax.Array):
                handle, separate = _start_transfer(tensor.source)
            started.append((following, handle, separate, nbytes))
            following += 1

    try:
        while started or following < len(tensors):
            start_more()
            index, handle, separate, nbytes = started.popleft()
            tensor = tensors[index]
            try:
                waited = time.perf_counter() if timing() else None
                value = tensor.get() if handle is None else np.asarray(handle)
                if waited is not None:
                    add_stage("transfer", time.perf_counter() - waited)
                if final and separate and tensor.owned:
                    tensor.source.delete()  # its bytes are on the host now
                handle = None
                if tuple(value.shape) != tensor.shape or np.dtype(value.dtype) != tensor.dtype:
                    raise RuntimeError(
                        f"{call()}: leaf '{tensor.name}' changed from "
                        f"{tensor.dtype}{list(tensor.shape)} to {value.dtype}"
                        f"{list(value.shape)} while it was being saved."
                    )
                yield tensor, value
            finally:
                value = None
                window.release(nbytes)
                if final and tensor.owned and isinstance(tensor.get, Pins):
                    tensor.get.release()  # the caller's buffers, held in place until now
                elif final and tensor.owned and not tensor.source.is_deleted():
                    # Read in place (a CPU device): a NumPy view the caller may still hold
                    # keeps the bytes alive; the runtime frees them once it is dropped.
                    tensor.source.delete()
    finally:
        for _, _, _, nbytes in started:
            window.release(nbytes)


def through_window(
    tensors: Sequence[Tensor], final: bool
) -> Generator[tuple[Tensor, np.ndarray], None, None]:
    """The format writer's leaf source in a save (`_format.leaves_from`): `host_arrays`
    within the window `_window.host_window_bytes` set."""
    return host_arrays(tensors, current_window(), final=final)


# --------------------------------------------------------------------------------------------
# Host -> device, a window at a time.


def callers_jax_settings() -> Callable[[], contextlib.AbstractContextManager[None]]:
    """A context that enters, in another thread, the JAX settings of this (the caller's)
    thread that decide what a placed leaf is: `jax.enable_x64` (float64 stays float64),
    `jax.default_device` (where a leaf without a sharding goes) and the mesh of
    `jax.set_mesh` / `jax.sharding.use_abstract_mesh` (what a `PartitionSpec` in a
    `ShapeDtypeStruct` means). JAX keeps them per thread, so a thread that places leaves
    for the caller would otherwise place them as if none were set."""
    x64 = jax.enable_x64.value
    device = jax.default_device.value
    mesh = jax.sharding.get_mesh()
    abstract_mesh = jax.sharding.get_abstract_mesh()

    @contextlib.contextmanager
    def enter() -> Iterator[None]:
        with (
            jax.enable_x64(x64),
            jax.default_device(device),
            jax.set_mesh(mesh),
            jax.sharding.use_abstract_mesh(abstract_mesh),
        ):
            yield

    return enter


def group_taken() -> None:
    """Called by `windowed_reads` right after the caller's thread takes a group off the
    reader's queue: a seam where tests deliver an interrupt at that exact point."""


def windowed_reads(
    names: Sequence[K],
    nbytes: Callable[[K], int],
    read_many: Callable[[list[K]], dict[K, np.ndarray]],
    window: HostWindow,
    settle: Callable[[list[K]], None],
    place: Callable[[K, np.ndarray], Any],
    check: Callable[[dict[K, np.ndarray]], None] | None = None,
) -> Generator[tuple[K, Any], None, None]:
    """`(name, place(name, host array))` for every name (a saved tensor's, or any key
    `read_many` reads, such as a span of one), in order, read in groups of at most a
    quarter of the window (at least one leaf each): background threads read (and verify)
    several groups at once while they fit in the window, and each thread places its group's
    leaves on their devices as soon as the group is read. A host-to-device copy from
    pageable memory is a memcpy on the calling thread, so placing in one thread would make
    it the restore's slowest stage. `place` runs with the caller's JAX settings
    (`callers_jax_settings`).

    Once the caller asks for the leaf after a group, `settle(group)` is called (it waits
    until the group's leaves are on their devices: one synchronisation per group, not per
    leaf), then the group's bytes count as released. With `check`, a group's host arrays
    (as `read_many` returned them) go to `check(arrays)` once their leaves are placed,
    while the transfers run; it raises for corrupt bytes, whose leaves the restore then
    drops. Errors of the reads, of `place` and of `check` are raised here.
    Closing the generator early, or an interrupt anywhere in it, cancels `window` (`window`
    belongs to this call alone): the reader threads stop, even while waiting for room, and
    every byte still held is released before the generator finishes.
    """
    groups: list[list[K]] = []
    size = 0
    for name in names:
        if not groups or (size + nbytes(name) > window.limit // GROUPS_PER_WINDOW and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes(name)
    done = queue.SimpleQueue()  # (group, pending read, bytes), then None; or an exception
    reads = ThreadPoolExecutor(GROUPS_PER_WINDOW, thread_name_prefix="eqx_train-restore-read")
    submitted: list[Future[Any]] = []
    submitting = Lock()  # (imported by name: tests swap the module `threading` here)
    settings = callers_jax_settings()

    def read_and_place(group: list[K]) -> dict[K, Any]:
        arrays = read_many(group)
        read = dict(arrays) if check is not None else {}
        try:
            with settings():
                placed = {name: place(name, arrays.pop(name)) for name in group}
        except BaseException:
            if check is not None:
                check(read)  # corrupt bytes explain a failed placement: their error wins
            raise
        if check is not None:
            check(read)
        return placed

    # Built here, on the caller's thread: the pool's threads name the caller's public call.
    read_and_place = in_context(read_and_place)

    def read_ahead() -> None:
        try:
            for group in groups:
                held = sum(nbytes(n) for n in group)
                window.acquire(held)  # raises Cancelled once the caller is gone
                with submitting:  # recorded with its submit: the end waits for each
                    submitted.append(reads.submit(read_and_place, group))
                done.put((group, submitted[-1], held))
            done.put(None)
        except Cancelled:
            return
        except BaseException as error:  # handed to the caller's thread
            done.put(error)

    reader = threading.Thread(target=read_ahead, name="eqx_train-restore-read", daemon=True)
    try:
        # Inside the `try`: the reader may already hold window bytes and place leaves when
        # an interrupt lands before `start` returns.
        reader.start()
        while True:
            item = done.get()
            group_taken()
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            group, pending, held = item
            results = pending.result()
            for name in group:
                yield name, results.pop(name)
            settle(group)
            window.release(held)
            del item, pending, results
    finally:
        # Whatever was taken, read or in flight when this ends (an interrupt may land
        # between any two lines above) is released here, from the window's own count.
        # Each step even if a second interrupt stops the one before: the threads end on their
        # own once the window is cancelled and the pool shut down.
        window.cancel()
        try:
            try:
                reader.join()
            except RuntimeError:  # interrupted before it started: it finds the window cancelled
                pass
        finally:
            try:
                # Not cut short by a second interrupt: the pool's threads may still write
                # into buffers the caller frees (or reuses: pinned blocks) once this ends.
                # Waited for by their futures, not by joining the threads: before Python
                # 3.13 an interrupted `Thread.join` can mark a running thread as ended.
                def finish() -> None:
                    reads.shutdown(wait=False, cancel_futures=True)  # no read starts now
                    with submitting:
                        running = list(submitted)
                    wait_started(running)

                wait_through_interrupts(finish)
                reads.shutdown(wait=True)
            finally:
                window.release_all()
