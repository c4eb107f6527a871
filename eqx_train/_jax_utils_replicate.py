"""`replicate`, `unreplicate`, `pmean` and `prefetch_to_device`: the pmap track's transfers
(one per call, whole pytrees, non-array leaves kept, replicas never gathered), and
`prefetch_to_device` with a sharding for the mesh track."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._tree import map_array_leaves_batched

_AXIS = "devices"

#: `jax.Device` (pyright cannot use JAX's alias of it as a type).
Device = Any
# A pytree's type, kept by functions that return a pytree of the same structure (the
# Equinox convention: `eqx.filter` returns the model's type with leaves replaced).
T = TypeVar("T")


def _device_axis_sharding(devices: Sequence[Device]) -> NamedSharding:
    """Leading axis split over `devices` in order: the layout `jax.pmap` expects."""
    mesh = Mesh(np.asarray(devices), (_AXIS,))
    return NamedSharding(mesh, PartitionSpec(_AXIS))


def replicate(tree: T, devices: Sequence[Device] | None = None) -> T:
    """Returns `tree` with a leading device axis on every array leaf, one replica per device.

    The result is laid out as `jax.pmap` expects (replica `i` lives on `devices[i]`), so
    `jax.pmap(f)(replicate(params), batch)` and `eqx.filter_pmap` work directly.

    **Arguments:**

    - `tree`: any pytree; an Equinox model may hold activation functions, static fields or
      `None`: every leaf that is not an array (including Python scalars) is returned as is.
    - `devices`: the devices to replicate to; `jax.local_devices()` by default (pmap's order).

    **Returns:**

    The pytree with each array leaf `x` replaced by a `jax.Array` of shape `(n, *x.shape)`.

    The whole tree moves in one `jax.device_put` to a replicated layout whose per-device
    buffers become the device-axis array without a further copy (flax first stacks `n` host
    copies). On CPU devices, which share host memory, all replicas alias one read-only host
    copy of each leaf.
    """
    devices = list(jax.local_devices() if devices is None else devices)
    if not devices:
        raise ValueError("replicate: `devices` is empty.")
    target = _device_axis_sharding(devices)

    def replicate_all(leaves: list[Any]) -> list[jax.Array]:
        if all(d.platform == "cpu" for d in devices):
            per_device = _replicate_on_cpu(leaves, devices)
        else:
            per_device = _replicate_by_transfer(leaves, devices, target)
        return [
            jax.make_array_from_single_device_arrays(
                (len(devices), *buffers[0].shape[1:]), target, buffers
            )
            for buffers in per_device
        ]

    return map_array_leaves_batched(replicate_all, tree)


def _replicate_by_transfer(
    leaves: list[Any], devices: list[Device], target: NamedSharding
) -> list[list[jax.Array]]:
    """One `device_put` of the whole tree to a replicated layout; its per-device buffers
    already have the `(1, *shape)` shape of a device-axis shard, so no further copy."""
    replicated = NamedSharding(target.mesh, PartitionSpec())
    placed = jax.device_put([leaf[None] for leaf in leaves], replicated)
    order = {d: k for k, d in enumerate(devices)}
    return [
        [s.data for s in sorted(array.addressable_shards, key=lambda s: order[s.device])]
        for array in placed
    ]


_XLA_ALIGNMENT = 64


def _aligned_copy(array: np.ndarray) -> np.ndarray:
    """A copy of `array` whose data starts on a 64-byte boundary (XLA only adopts such)."""
    raw = np.empty(array.nbytes + _XLA_ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % _XLA_ALIGNMENT
    out = raw[start : start + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


def _replicate_on_cpu(leaves: list[Any], devices: list[Device]) -> list[list[jax.Array]]:
    """CPU devices share host memory: every device's buffer aliases one read-only host copy
    (JAX adopts read-only, aligned NumPy memory without copying), so replicating costs one
    copy instead of one per device. The copy also isolates the result from later mutation
    of a NumPy input."""
    hosts = []
    for leaf in leaves:
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            hosts.append(leaf[None])  # key arrays have no NumPy view; transfer them normally
            continue
        host = np.asarray(leaf)[None]
        if host.flags.writeable or host.ctypes.data % _XLA_ALIGNMENT:
            host = _aligned_copy(host)
            host.flags.writeable = False
        hosts.append(host)
    flat = jax.device_put([h for h in hosts for _ in devices], [d for _ in hosts for d in devices])
    n = len(devices)
    return [flat[k * n : (k + 1) * n] for k in range(len(hosts))]


def _one_replica(x: Any) -> Any:
    """One replica of array `x`, or `(host_view, device)` when it is best made by the batched
    `device_put` in `unreplicate` (CPU: JAX adopts a read-only NumPy view of the buffer
    without copying, and keeps the source alive, declining to donate it, while it lives)."""
    if not isinstance(x, jax.Array):
        return x[0] if x.ndim else x
    if x.ndim == 0:
        return x
    data = x.addressable_shards[0].data
    if x.sharding.is_fully_replicated and len(x.sharding.device_set) > 1:
        return data  # every device holds the whole array: it is one replica already (as flax)
    if data.shape[0] != 1:
        return x[0]
    (device,) = data.devices()
    if device.platform == "cpu" and not jnp.issubdtype(data.dtype, jax.dtypes.prng_key):
        return (np.asarray(data)[0], device)
    return data.reshape(data.shape[1:])


def _unreplicate_all(leaves: list[Any]) -> list[Any]:
    results = [_one_replica(leaf) for leaf in leaves]
    pending = [i for i, r in enumerate(results) if isinstance(r, tuple)]
    if pending:
        views, devices = zip(*(results[i] for i in pending), strict=True)
        for i, array in zip(pending, jax.device_put(list(views), list(devices)), strict=True):
            results[i] = array
    return results


def unreplicate(tree: T) -> T:
    """Returns one replica of a replicated pytree: element 0 of every array leaf's first axis.

    The replica is read from the device that holds it (`addressable_shards[0]`), never via
    `x[0]` on the global array, which would gather every replica first; on CPU it is a
    zero-copy view of that device's buffer. Non-array leaves are returned unchanged, 0-d
    arrays as they are, and an array fully replicated over several devices is returned as
    its first device's copy (all as flax does).

    **Arguments:**

    - `tree`: a pytree as returned by `replicate` or by a pmapped function.

    **Returns:**

    The pytree with each array leaf's leading device axis removed.
    """
    return map_array_leaves_batched(_unreplicate_all, tree)


def pmean(xs: T, axis_name: Any) -> T:
    """`jax.lax.pmean(xs, axis_name)`: the mean of `xs` over a named mapped axis.

    Kept for flax users (flax's version emits a `DeprecationWarning`; this one does not).
    Use inside `jax.pmap`, `eqx.filter_pmap` or `jax.shard_map` with a matching axis name.
    """
    return jax.lax.pmean(xs, axis_name)


def prefetch_to_device(
    iterator: Iterable[T],
    size: int,
    devices: Sequence[Device] | jax.sharding.Sharding | None = None,
) -> Iterator[T]:
    """Yields the batches of `iterator` already placed on device, keeping `size` in flight.

    **Arguments:**

    - `iterator`: yields pytrees whose array leaves have a leading axis of length
      `len(devices)` (e.g. from `eqx_train.shard`); non-array leaves pass through.
    - `size`: how many batches to transfer ahead (>= 1); 2 is usually right on GPUs, so a
      transfer overlaps each step.
    - `devices`: the devices to shard the leading axis over (default `jax.local_devices()`),
      or any `jax.sharding.Sharding` to place every leaf with (then leaves need only fit that
      sharding, e.g. a batch-sharded `NamedSharding` for a `jax.jit` training step).

    **Yields:**

    The original batches, in order, with array leaves as sharded `jax.Array`s. Each batch is
    transferred with one asynchronous `jax.device_put`; at most `size` transferred batches are
    held at a time. Ends when `iterator` ends.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"prefetch_to_device: size must be an int >= 1, got {size!r}.")
    if isinstance(devices, jax.sharding.Sharding):
        sharding: jax.sharding.Sharding = devices
    else:
        sharding = _device_axis_sharding(list(jax.local_devices() if devices is None else devices))

    def place(batch: T) -> T:
        return map_array_leaves_batched(lambda leaves: jax.device_put(leaves, sharding), batch)

    source = iter(iterator)
    queue: collections.deque[T] = collections.deque(
        place(batch) for batch in itertools.islice(source, size)
    )
    while queue:
        ready = queue.popleft()
        for batch in itertools.islice(source, 1):
            queue.append(place(batch))
        yield ready
