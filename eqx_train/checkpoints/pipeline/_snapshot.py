"""Snapshots: values of an async save that no later change of the caller's buffers can reach.

An async save copies its array leaves on their own devices (one jitted copy per set of
devices, no donation, same shardings) and returns; the caller may then donate or overwrite
its buffers. Before copying, the free device memory is checked; under `"auto"` a snapshot
that would not fit is taken on the host instead, and a warning says so once; under
`"device"` a copy the device has no room for raises an error naming the bytes needed and
free. On CPU devices `"auto"` copies nothing: NumPy views hold the buffers in place
(`_transfer.Pins`), which the runtime then never donates, until each leaf is written.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..._calls import call
from . import _transfer
from ._options import SNAPSHOT_MODES as SNAPSHOT_MODES, SnapshotMode as SnapshotMode
from ._window import current_window

if TYPE_CHECKING:
    import jax
    import jax.numpy as jnp

    from ..format._description import Tensor
else:  # imported on first use: the command line reads headers without JAX
    from ..._lazy import LazyModule

    jax = LazyModule("jax")
    jnp = LazyModule("jax.numpy")

# A device snapshot must fit in this share of the free device memory: the training step that
# runs next needs room for its own temporaries.
DEVICE_MEMORY_SHARE = 0.8


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
        return host_available_bytes()
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


def host_available_bytes() -> int | None:
    """The host memory available to new allocations, or None where the system does not say."""
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


def _shortfall(arrays: Sequence[jax.Array], share: float) -> tuple[Any, int, int] | None:
    """`(device, bytes needed, bytes free)` for the first device on which a copy of `arrays`
    does not fit in `share` of the free memory, or None if it fits everywhere (devices
    whose backend reports nothing count as fitting)."""
    need = device_bytes_needed(arrays)
    on_host = sum(n for d, n in need.items() if d.platform == "cpu")
    for device, nbytes in need.items():
        if device.platform == "cpu":
            nbytes = on_host  # every CPU device's memory is the same host memory
        free = free_device_bytes(device)
        if free is not None and nbytes > share * free:
            return device, nbytes, max(free, 0)
    return None


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.0f} MiB"


def snapshot_fits(arrays: Sequence[jax.Array]) -> tuple[bool, str]:
    """Whether a device copy of `arrays` fits in `DEVICE_MEMORY_SHARE` of each device's
    free memory (devices whose backend reports none count as fitting), and if not, where it
    does not."""
    short = _shortfall(arrays, DEVICE_MEMORY_SHARE)
    if short is None:
        return True, ""
    device, nbytes, free = short
    return False, f"it needs {_mib(nbytes)} on {device} and {_mib(free)} are free"


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


def _pinnable(array: jax.Array) -> bool:
    """Whether `array`'s bytes can be held in place: on this process's CPU devices only, in
    a dtype NumPy knows (not a PRNG key's)."""
    return (
        array.is_fully_addressable
        and all(_transfer.reads_in_place(d.platform) for d in array.sharding.device_set)
        and isinstance(array.dtype, np.dtype)  # not an extended dtype
    )


def another_fits(tensors: Sequence[Tensor], mode: SnapshotMode) -> bool:
    """Whether a snapshot of `tensors` can be taken now, next to one already held by a save
    in flight, without waiting for that save: where its copy would go (device or host)
    has room for it in `DEVICE_MEMORY_SHARE` of what is free (CPU buffers held in place
    need none)."""
    sources = [_device_source(t) for t in tensors]
    copied = [s for s in sources if s is not None and not (mode == "auto" and _pinnable(s))]
    if mode != "host":
        return _shortfall(copied, DEVICE_MEMORY_SHARE) is None
    nbytes = sum(t.nbytes for t in tensors)
    free = host_available_bytes()
    return free is None or nbytes <= DEVICE_MEMORY_SHARE * free


def snapshot(
    tensors: Sequence[Tensor],
    mode: SnapshotMode,
    *,
    warn: Callable[[str], None],
) -> list[Tensor]:
    """The tensors with values that no later change of the caller's buffers can reach.

    `"device"`: array leaves copied on their devices (the copies are owned by the save and
    freed as it writes them; a copy the devices have no memory for raises `MemoryError`
    naming the bytes needed and free); `"host"`: every leaf copied to host memory now, leaf
    by leaf; `"auto"`: on the devices if the copy fits in their free memory, else on the
    host with a message to `warn` (also when the copy, estimated to fit, finds no room as it
    runs); on CPU devices, the buffers held in place (`Pins`,
    released by the final pass of `host_arrays`). Non-array leaves (NumPy arrays, scalars)
    are always copied on the host.
    """
    sources = [_device_source(t) for t in tensors]
    # On a CPU device the cheapest snapshot is no copy at all: NumPy views of its buffers,
    # held until the save is written, and the runtime never donates a buffer that such a
    # view references (a donating step gets fresh memory instead, as it would while a device
    # copy is held). Only where the choice is ours ("auto"): "device" still copies.
    pinned = {
        id(s): _transfer.Pins(s)
        for s in sources
        if s is not None and mode == "auto" and _pinnable(s)
    }
    on_device = [s for s in sources if s is not None and id(s) not in pinned]
    if mode == "auto" and on_device:
        fits, why = snapshot_fits(on_device)
        if not fits:
            warn(
                f"{call()}: the async save's device snapshot would not fit in device memory "
                f"({why}); the state is copied to host memory instead, which blocks for the "
                "transfer. Pass snapshot='host' to choose this and silence the warning."
            )
            mode = "host"
    copies: dict[int, jax.Array] = {}
    if mode != "host":
        try:
            copies = _copy_on_devices(on_device)
        except MemoryError:
            if mode != "auto":
                raise
            # The estimate said it fits but the copy found no room when it ran (another
            # allocation in between, fragmentation): the choice is ours, so the host.
            warn(
                f"{call()}: the async save's device snapshot, estimated to fit, found no room "
                "in device memory when it ran; the state is copied to host memory instead, "
                "which blocks for the transfer. Pass snapshot='host' to choose this and "
                "silence the warning."
            )
    on_host = [
        t
        for t, s in zip(tensors, sources, strict=True)
        if s is None or (id(s) not in copies and id(s) not in pinned)
    ]
    values = {}
    # Through the window: pinned staging a few leaves at a time, then pageable copies.
    with contextlib.closing(_transfer.host_arrays(on_host, current_window(), final=False)) as got:
        for tensor, value in got:
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
        if isinstance(tensor.get, _transfer.Pins):
            tensor.get.release()
        elif tensor.owned and isinstance(tensor.source, jax.Array):
            if not tensor.source.is_deleted():
                tensor.source.delete()


def _out_of_memory(error: BaseException) -> bool:
    """Whether `error` is the runtime's report of a device allocation that failed."""
    return "RESOURCE_EXHAUSTED" in str(error) or "out of memory" in str(error).lower()


def _copy_on_devices(arrays: Sequence[jax.Array]) -> dict[int, jax.Array]:
    """`id(array) -> its device copy`. One jitted copy per set of devices (a computation
    runs on one device assignment). An array spread over several processes is copied shard
    by shard on this process's devices and reassembled: no computation spans processes, so
    no process waits for another (they may decide differently between device and host).

    A copy the devices have no memory for, whether its dispatch or its run finds no room,
    raises `MemoryError` naming the bytes needed and free; the copies already made are freed
    first."""
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
        group_copies: list[jax.Array] = []
        try:
            group_copies = _device_copy(group)
            # The runtime allocates a copy's buffers when it runs, not when it is
            # dispatched: waiting for them (milliseconds) reports a device without room
            # here, at the call, rather than from the writer or the next save.
            for copy in group_copies:
                copy.block_until_ready()
        except Exception as error:
            if not _out_of_memory(error):
                raise
            for copy in [*copied.values(), *group_copies]:
                copy.delete()
            raise MemoryError(_no_room_message(group)) from error
        for part, copy in zip(group, group_copies, strict=True):
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


def _no_room_message(group: Sequence[jax.Array]) -> str:
    need = device_bytes_needed(group)
    device, nbytes = max(need.items(), key=lambda item: item[1])
    free = free_device_bytes(device)
    free_text = "an unknown amount" if free is None else _mib(max(free, 0))
    return (
        f"{call()}: snapshot='device' needs {_mib(nbytes)} on {device} for its copy of the "
        f"state and {free_text} {'is' if free is None else 'are'} free; nothing was saved. "
        "Pass snapshot='host' to copy the state to host memory instead (it blocks for the "
        "transfer), or snapshot='auto' to choose by the memory free at each save."
    )


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
