"""Bytes between processes over the devices' interconnect: one jitted collective permute
(`jax.lax.ppermute` under `shard_map`) on a mesh of one device per process, so that a
local tier's copies travel the way the arrays do (NVLink or ICI on accelerators, gloo on
CPU), never through the persistent store nor the coordination service.

Every process calls `shift_bytes` with the same `shift` and the same `sizes` (agreed
beforehand through the coordination service); process `i` sends its payload to process
`(i + shift) % n` and receives the payload of process `(i - shift) % n`. Payloads are padded
to the largest one, so a call moves `max(sizes)` bytes per sending process.

On CPU the collective needs gloo:
`jax.config.update("jax_cpu_collectives_implementation", "gloo")` before
`jax.distributed.initialize`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import jax
else:  # imported on first use: the command line reads headers without JAX
    from ..._lazy import LazyModule

    jax = LazyModule("jax")

from ..._calls import call


def _process_devices() -> list[Any]:
    """One device per process (its lowest id), in process order."""
    first: dict[int, Any] = {}
    for device in jax.devices():
        held = first.get(device.process_index)
        if held is None or device.id < held.id:
            first[device.process_index] = device
    return [first[p] for p in range(jax.process_count())]


def shift_bytes(payload: bytes | None, shift: int, sizes: Sequence[int]) -> bytes | None:
    """What process `(me - shift) % n` sent, after every process sent its `payload` to
    process `(me + shift) % n`.

    **Arguments:**

    - `payload`: this process's bytes (`None` to send nothing).
    - `shift`: how far along the processes each payload travels (1 to n - 1).
    - `sizes`: every process's payload size, in process order (-1 for none); the same list
      on every process.

    **Returns:**

    The bytes received, or `None` when the sender sent nothing.

    **Raises:**

    `ValueError` when `payload` does not have the size `sizes` gives this process.
    """
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    count, me = jax.process_count(), jax.process_index()
    mine = -1 if payload is None else len(payload)
    if len(sizes) != count or sizes[me] != mine:
        raise ValueError(
            f"{call()}: the transfer's sizes {list(sizes)} do not give process {me} the "
            f"{mine} bytes of its payload ({count} processes)."
        )
    width = max(1, *sizes)
    row = np.zeros((1, width), np.uint8)
    if payload:
        row[0, : len(payload)] = np.frombuffer(payload, np.uint8)
    devices = _process_devices()
    mesh = Mesh(np.array(devices), ("processes",))
    spec = PartitionSpec("processes")
    block = jax.device_put(row, devices[me])
    rows = jax.make_array_from_single_device_arrays(
        (count, width), NamedSharding(mesh, spec), [block]
    )
    # Only the processes that send take part in the permutation: the others' rows (padding)
    # never travel.
    pairs = [(i, (i + shift) % count) for i in range(count) if sizes[i] >= 0]
    moved = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.ppermute(x, "processes", pairs),
            mesh=mesh,
            in_specs=spec,
            out_specs=spec,
        )
    )(rows)
    received = sizes[(me - shift) % count]
    if received < 0:
        return None
    return np.asarray(moved.addressable_shards[0].data)[0, :received].tobytes()
