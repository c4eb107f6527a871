"""Moving leaf bytes between devices and the host for saves and restores.

Two promises live here:

- **A snapshot that outlives the caller's buffers is a device-side copy.** An async save
  copies its array leaves on their own devices (one jitted copy per set of devices, no
  donation, same shardings) and returns; the caller may then donate or overwrite its
  buffers. Before copying, the free device memory is checked; a snapshot that would not fit
  is taken on the host instead, and a warning says so once. On CPU devices `"auto"` copies
  nothing: NumPy views hold the buffers in place (`Pins`), which the runtime then never
  donates, until each leaf is written.
- **The host holds a bounded window of leaf bytes.** A save moves leaves to the host a few
  at a time, in order, starting the transfers of the next leaves (into pinned host memory,
  several in flight) before the writer consumes the current one, and lets each leaf's host
  bytes go once they are written; a restore reads, verifies and places leaves the same way.
  At most `host_window_bytes` are held at once, and always at least one leaf.

`HostWindow` counts the bytes a pipeline holds; `held_bytes()` / `peak_held_bytes()` sum
them over every pipeline of the process (they are what the memory tests measure: on a CPU
backend, process RSS also counts device memory and the allocator's caches).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import queue
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    import jax
    import jax.numpy as jnp

    from ._description import Tensor
else:  # imported on first use: the command line reads headers without JAX
    from .._lazy import LazyModule

    jax = LazyModule("jax")
    jnp = LazyModule("jax.numpy")

SnapshotMode = Literal["auto", "device", "host"]
SNAPSHOT_MODES: tuple[str, ...] = ("auto", "device", "host")
DEFAULT_HOST_WINDOW_BYTES = 256 << 20
# A device snapshot must fit in this share of the free device memory: the training step that
# runs next needs room for its own temporaries.
DEVICE_MEMORY_SHARE = 0.8


def check_options(snapshot: str, host_window_bytes: Any, caller: str) -> None:
    """Refuses a `snapshot` mode or a `host_window_bytes` that is not one we know."""
    if snapshot not in SNAPSHOT_MODES:
        raise ValueError(
            f"{caller}: snapshot must be one of {', '.join(map(repr, SNAPSHOT_MODES))}, got "
            f"{snapshot!r}."
        )
    check_window(host_window_bytes, caller)


def check_window(host_window_bytes: Any, caller: str) -> None:
    if (
        not isinstance(host_window_bytes, int | np.integer)
        or isinstance(host_window_bytes, bool)
        or host_window_bytes < 1
    ):
        raise ValueError(
            f"{caller}: host_window_bytes must be a positive int (bytes), got "
            f"{host_window_bytes!r}."
        )


# --------------------------------------------------------------------------------------------
# The host window: how many leaf bytes the pipelines hold on the host.

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


class HostWindow:
    """Admits leaf bytes up to `limit` at once (a leaf bigger than `limit` alone), blocking
    `acquire` until enough earlier bytes are released. Thread-safe: a restore's reader
    threads acquire while its placing thread releases."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.in_use = 0
        self._free = threading.Condition()

    def fits(self, nbytes: int) -> bool:
        return self.in_use == 0 or self.in_use + nbytes <= self.limit

    def acquire(self, nbytes: int) -> None:
        with self._free:
            self._free.wait_for(lambda: self.fits(nbytes))
            self.in_use += nbytes
        _count(nbytes)

    def release(self, nbytes: int) -> None:
        with self._free:
            self.in_use -= nbytes
            self._free.notify_all()
        _count(-nbytes)


# --------------------------------------------------------------------------------------------
# Device snapshots.


def _copy_arrays(arrays: Sequence[jax.Array]) -> list[jax.Array]:
    return [jnp.copy(a) for a in arrays]


_copy_jit: Any = None


def _device_copy(arrays: list[jax.Array]) -> list[jax.Array]:
    """New buffers holding the same values, on the same devices with the same shardings,
    from one jitted computation (the inputs are not donated, so they stay the caller's)."""
    global _copy_jit
    if _copy_jit is None:
        _copy_jit = jax.jit(_copy_arrays)
    copies = _copy_jit(arrays)
    # A copy keeps its input's sharding; should a runtime ever lay one out otherwise, it is
    # moved back, so that a restore of the file sees the layout the caller had.
    return [
        c if c.sharding == a.sharding else jax.device_put(c, a.sharding)
        for a, c in zip(arrays, copies, strict=True)
    ]


def free_device_bytes(device: Any) -> int | None:
    """Free memory of `device` in bytes, or None where the backend does not say. A CPU
    device's memory is the host's: its free memory is the host's available memory."""
    if device.platform == "cpu":
        return _host_available_bytes()
    try:
        stats = device.memory_stats()
    except Exception:  # backends without memory statistics raise or return None
        return None
    if not stats:
        return None
    limit = stats.get("bytes_reservable_limit") or stats.get("bytes_limit")
    if not limit:
        return None
    return int(limit) - int(stats.get("bytes_in_use", 0))


def _host_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def device_bytes_needed(arrays: Sequence[jax.Array]) -> dict[Any, int]:
    """Bytes a copy of `arrays` takes on each local device (a replicated array counts on
    every device that holds it)."""
    need: dict[Any, int] = {}
    for array in arrays:
        nbytes = math.prod(array.sharding.shard_shape(array.shape)) * array.dtype.itemsize
        for device in array.sharding.addressable_devices:
            need[device] = need.get(device, 0) + nbytes
    return need


def snapshot_fits(arrays: Sequence[jax.Array]) -> tuple[bool, str]:
    """Whether a device copy of `arrays` fits in `DEVICE_MEMORY_SHARE` of each device's
    free memory (devices whose backend reports none count as fitting), and if not, where it
    does not."""
    need = device_bytes_needed(arrays)
    on_host = sum(n for d, n in need.items() if d.platform == "cpu")
    for device, nbytes in need.items():
        if device.platform == "cpu":
            nbytes = on_host  # every CPU device's memory is the same host memory
        free = free_device_bytes(device)
        if free is not None and nbytes > DEVICE_MEMORY_SHARE * free:
            return False, (
                f"it needs {nbytes / 2**20:.0f} MiB on {device} and "
                f"{max(free, 0) / 2**20:.0f} MiB are free"
            )
    return True, ""


def _device_source(tensor: Tensor) -> jax.Array | None:
    """The `jax.Array` a tensor's bytes come from, if a device copy of it can be taken."""
    source = tensor.source
    if not isinstance(source, jax.Array) or source.is_deleted():
        return None
    memory_kind = getattr(source.sharding, "memory_kind", None)
    default = None
    try:
        default = next(iter(source.sharding.device_set)).default_memory().kind
    except Exception:  # a runtime without memory kinds
        pass
    if memory_kind is not None and default is not None and memory_kind != default:
        return None  # already on the host (pinned_host/unpinned_host): copied on the host
    return source


def snapshot(
    tensors: Sequence[Tensor],
    mode: SnapshotMode,
    *,
    caller: str,
    warn: Callable[[str], None],
) -> list[Tensor]:
    """The tensors with values that no later change of the caller's buffers can reach.

    `"device"`: array leaves copied on their devices (the copies are owned by the save and
    freed as it writes them); `"host"`: every leaf copied to host memory now, leaf by leaf;
    `"auto"`: on the devices if the copy fits in their free memory, else on the host with a
    message to `warn`; on CPU devices, the buffers held in place (`Pins`, released by the
    final pass of `host_arrays`). Non-array leaves (NumPy arrays, scalars) are always copied
    on the host.
    """
    sources = [_device_source(t) for t in tensors]
    # On a CPU device the cheapest snapshot is no copy at all: NumPy views of its buffers,
    # held until the save is written, and the runtime never donates a buffer that such a
    # view references (a donating step gets fresh memory instead, as it would while a device
    # copy is held). Only where the choice is ours ("auto"): "device" still copies.
    pinned = {id(s): Pins(s) for s in sources if s is not None and mode == "auto" and _pinnable(s)}
    on_device = [s for s in sources if s is not None and id(s) not in pinned]
    if mode == "auto" and on_device:
        fits, why = snapshot_fits(on_device)
        if not fits:
            warn(
                f"{caller}: the async save's device snapshot would not fit in device memory "
                f"({why}); the state is copied to host memory instead, which blocks for the "
                "transfer. Pass snapshot='host' to choose this and silence the warning."
            )
            mode = "host"
    copies = _copy_on_devices(on_device) if mode != "host" else {}
    on_host = [
        t
        for t, s in zip(tensors, sources, strict=True)
        if s is None or (id(s) not in copies and id(s) not in pinned)
    ]
    values = {}
    # Through the window: pinned staging a few leaves at a time, then pageable copies.
    with contextlib.closing(host_arrays(on_host, current_window(), final=False)) as leaves:
        for tensor, value in leaves:
            values[tensor.name] = np.array(value, copy=True)
    # A leaf that appears twice in the tree (tied weights) shares its pins or device copy:
    # only its last tensor owns them, so they are let go after its last use.
    last_use = {id(s): i for i, s in enumerate(sources) if s is not None}
    result = []
    for i, (tensor, source) in enumerate(zip(tensors, sources, strict=True)):
        owner = source is not None and last_use[id(source)] == i
        if tensor.name in values:
            get = lambda v=values[tensor.name]: v  # noqa: E731
            result.append(replace(tensor, get=get, source=None, owned=False))
        elif source is not None and id(source) in pinned:
            result.append(replace(tensor, get=pinned[id(source)], source=None, owned=owner))
        else:
            copy = copies[id(source)]
            get = lambda c=copy: np.asarray(c)  # noqa: E731
            result.append(replace(tensor, get=get, source=copy, owned=owner))
    return result


def release(tensors: Sequence[Tensor]) -> None:
    """Lets go of what a snapshot holds for the save of `tensors` (pinned buffers, device
    copies), whatever is left of it: after the save, written or failed, so that a failed
    save's snapshot does not live on in its traceback."""
    for tensor in tensors:
        if isinstance(tensor.get, Pins):
            tensor.get.release()
        elif tensor.owned and isinstance(tensor.source, jax.Array):
            if not tensor.source.is_deleted():
                tensor.source.delete()


def _pinnable(array: jax.Array) -> bool:
    """Whether `array`'s bytes can be held in place: on this process's CPU devices only, in
    a dtype NumPy knows (not a PRNG key's)."""
    return (
        array.is_fully_addressable
        and all(_reads_in_place(d.platform) for d in array.sharding.device_set)
        and isinstance(array.dtype, np.dtype)  # not an extended dtype
    )


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


def _copy_on_devices(arrays: Sequence[jax.Array]) -> dict[int, jax.Array]:
    """`id(array) -> its device copy`. One jitted copy per set of devices (a computation
    runs on one device assignment). An array spread over several processes is copied shard
    by shard on this process's devices and reassembled: no computation spans processes, so
    no process waits for another (they may decide differently between device and host)."""
    parts: dict[int, list[jax.Array]] = {}
    groups: dict[tuple[int, ...], list[jax.Array]] = {}
    for array in arrays:
        if array.is_fully_addressable:
            parts[id(array)] = [array]
        else:
            parts[id(array)] = [shard.data for shard in array.addressable_shards]
        for part in parts[id(array)]:
            key = tuple(sorted(d.id for d in part.sharding.device_set))
            groups.setdefault(key, []).append(part)
    copied: dict[int, jax.Array] = {}
    for group in groups.values():
        for part, copy in zip(group, _device_copy(group), strict=True):
            copied[id(part)] = copy
    copies = {}
    for array in arrays:
        if array.is_fully_addressable:
            copies[id(array)] = copied[id(array)]
        else:
            copies[id(array)] = jax.make_array_from_single_device_arrays(
                array.shape, array.sharding, [copied[id(p)] for p in parts[id(array)]]
            )
    return copies


class WarnOnce:
    """A `warn` for `snapshot` that warns the first time only."""

    def __init__(self) -> None:
        self.warned = False

    def __call__(self, message: str) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(message, UserWarning, stacklevel=4)


_warners: weakref.WeakKeyDictionary[Any, WarnOnce] = weakref.WeakKeyDictionary()


def warn_once_per(owner: Any) -> WarnOnce:
    """The `warn` for the snapshots of `owner` (an async manager): it says so once."""
    return _warners.setdefault(owner, WarnOnce())


# --------------------------------------------------------------------------------------------
# Device -> host, a window at a time.


_pinned_refused: set[str] = set()  # platforms whose runtime refused a pinned_host transfer


def _reads_in_place(platform: str) -> bool:
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
    if _reads_in_place(platform):
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
    nbytes = math.prod(tensor.shape) * tensor.dtype.itemsize
    source = tensor.source
    if (
        isinstance(source, jax.Array)
        and len(source.sharding.device_set) > 1
        and not source.is_fully_replicated
        and not _reads_in_place(next(iter(source.sharding.device_set)).platform)
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
                value = tensor.get() if handle is None else np.asarray(handle)
                if final and separate and tensor.owned:
                    tensor.source.delete()  # its bytes are on the host now
                handle = None
                if tuple(value.shape) != tensor.shape or np.dtype(value.dtype) != tensor.dtype:
                    raise RuntimeError(
                        f"save_checkpoint: leaf '{tensor.name}' changed from "
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


# --------------------------------------------------------------------------------------------
# Host -> device, a window at a time.


def windowed_reads(
    names: Sequence[str],
    nbytes: Callable[[str], int],
    read_many: Callable[[list[str]], dict[str, np.ndarray]],
    window: HostWindow,
) -> Generator[tuple[str, np.ndarray], None, None]:
    """`(name, host array)` for every name, in order, read in groups of at most half the
    window (at least one leaf each): a background thread reads (and verifies) the next
    group while the caller places the current one on its devices. A group's bytes count as
    released once the caller asks for the leaf after it, so the caller must be done with
    (have placed) a group's arrays by then. Errors of the reads are raised here; closing the
    generator early stops the reader thread.
    """
    groups: list[list[str]] = []
    size = 0
    for name in names:
        if not groups or (size + nbytes(name) > window.limit // 2 and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes(name)
    done = queue.SimpleQueue()  # (group, arrays, bytes), then None; or an exception
    stop = threading.Event()

    def read_ahead() -> None:
        try:
            for group in groups:
                held = sum(nbytes(n) for n in group)
                window.acquire(held)
                if stop.is_set():
                    window.release(held)
                    return
                try:
                    arrays = read_many(group)
                except BaseException:
                    window.release(held)
                    raise
                done.put((group, arrays, held))
            done.put(None)
        except BaseException as error:  # handed to the caller's thread
            done.put(error)

    reader = threading.Thread(target=read_ahead, name="eqx_train-restore-read", daemon=True)
    reader.start()
    try:
        while (item := done.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            group, arrays, held = item
            try:
                for name in group:
                    yield name, arrays.pop(name)
            finally:
                arrays.clear()
                window.release(held)
    finally:
        stop.set()
        while reader.is_alive() or not done.empty():
            try:
                item = done.get(timeout=0.05)
            except queue.Empty:
                continue
            if isinstance(item, tuple):
                window.release(item[2])  # read, never placed: the reader may wait for it
        reader.join()
