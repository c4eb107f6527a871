"""Read-once restore across processes: when a target places one block of an array on
devices of several processes (a data-parallel replica on every host), each of them reads
only its run of that block from the store, and one jitted resharding assembles the blocks
over the interconnect (an all-gather: NVLink or ICI on accelerators, gloo on CPU). The job
then reads the checkpoint once, where reading block by block (`_restore._read_blockwise`)
reads it once per process.

The runs are those of a replica-parallel save (`_runs.split_axis`, the same rule): a
restore onto the processes that saved reads exactly the pieces each of them wrote, which
matters because a verified read reads every piece it touches whole.

Every process of the job takes part: the choice of leaves depends only on the target's
shardings, which are the same everywhere, and the processes report to each other whether
their reads succeeded before any of them enters the collective, so that a corrupt or
missing piece seen by one process fails the restore on all of them (with the same kind
of error: a `CheckpointFormatError`, or `FileNotFoundError` for a checkpoint replaced
meanwhile, which every process then retries) instead of leaving the others waiting.
A process that restores alone (its peers elsewhere, or dead) waits `TIMEOUT_S` for them,
then reads block by block as before, with a warning: the exchange fails on every process
or on none, so no process enters the collective without the others. Its peers' next
read-once restore finds that exchange given up and moves on to the next (`_exchange`), so
one lone restore does not put the processes' exchanges out of step for good; and the
processes compare what they opened and what they read once before the resharding, so two
different restores (or two checkpoints) are never assembled into one array.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import jax
    from jax.sharding import NamedSharding
else:  # imported on first use: the command line reads headers without JAX
    from ..._lazy import LazyModule

    jax = LazyModule("jax")

from ..._calls import call
from .._errors import CheckpointFormatError
from ..format import _runs
from . import _coordination

# How long a process waits for its peers before reading alone; a process arriving later
# finds the exchange failed, and waits as long again at the next one (see `_exchange`).
TIMEOUT_S = 60.0
# The most exchanges a process that came late skips through to find its peers'.
_MAX_SKIPS = 64


def _spanning_axes(mesh: Any) -> set[str]:
    """The mesh axes along which the devices belong to different processes."""
    owner = np.vectorize(lambda d: d.process_index)(mesh.devices)
    return {
        name
        for i, name in enumerate(mesh.axis_names)
        if np.any(owner != np.take(owner, [0], axis=i))
    }


def staging_sharding(leaf: Any) -> NamedSharding | None:
    """The sharding a target `leaf` (a `jax.Array` or `jax.ShapeDtypeStruct`) is read into
    before the resharding: its own, with each block also cut along one axis over the mesh
    axes that replicate it across processes; None when the target has no block on several
    processes (or no such cut: then it is read block by block, as before)."""
    sharding = getattr(leaf, "sharding", None)
    if jax.process_count() == 1 or not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    shape, mesh = tuple(leaf.shape), sharding.mesh
    entries: list[Any] = [*sharding.spec, *[None] * (len(shape) - len(sharding.spec))]
    named = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries]
    used = {axis for axes in named for axis in axes}
    free = [n for n in mesh.axis_names if n not in used and n in _spanning_axes(mesh)]
    parts = math.prod(mesh.shape[n] for n in free)
    if parts <= 1:
        return None
    cut = [math.prod(mesh.shape[n] for n in axes) for axes in named]
    if any(d % c for d, c in zip(shape, cut, strict=True)):
        return None  # uneven blocks: read block by block
    axis = _runs.split_axis([d // c for d, c in zip(shape, cut, strict=True)], parts)
    if axis is None or (shape[axis] // cut[axis]) % parts:
        return None
    entries[axis] = (*named[axis], *free)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*entries))


def _read_staged(reader: Any, name: str, leaf: Any, staging: Any, verify: bool) -> jax.Array:
    """Array `name` in the `staging` sharding: this process reads each of its runs once."""
    shape = tuple(leaf.shape)
    read: dict[tuple[tuple[int, int], ...], np.ndarray] = {}
    blocks = []
    for device, index in staging.addressable_devices_indices_map(shape).items():
        bounds = tuple(s.indices(d)[:2] for s, d in zip(index, shape, strict=True))
        if bounds not in read:
            read[bounds] = reader.read(name, tuple(slice(*b) for b in bounds), verify=verify)
        blocks.append(jax.device_put(read[bounds], device))
    return jax.make_array_from_single_device_arrays(shape, staging, blocks)


def _exchange(status: str) -> list[str]:
    """Every process's `status`, under the next `read_once` number. A process that finds the
    number's exchange already given up by a peer that waited for it (`late`) is behind: a
    peer restored once without it (alone, or while it was held up), so the peer's next
    restore uses the next number; it tries that one at once. Without this, one restore a
    process makes alone would make every later one wait `TIMEOUT_S` and read everything."""
    for skipped in range(_MAX_SKIPS + 1):
        op = _coordination.op_id("read_once", str(_coordination.next_number("read_once")))
        try:
            return _coordination.gather(op, status, timeout_s=TIMEOUT_S)
        except _coordination.BarrierTimeoutError as error:
            if not error.late or skipped == _MAX_SKIPS:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def _fall_back(staged: list[jax.Array], why: str, reader: Any) -> dict[str, jax.Array]:
    for array in staged:
        array.delete()
    warnings.warn(
        f"{why} So each process read every block its devices hold from {reader.path}, "
        "instead of its share. A process restoring without its peers can say "
        "replica_parallel=False to skip the wait.",
        stacklevel=5,
    )
    return {}


def _plan_digest(chosen: list[tuple[str, Any, Any]]) -> str:
    """What this call reads once: the names, shapes, dtypes and target shardings."""
    plan = [(n, list(leaf.shape), str(leaf.dtype), repr(leaf.sharding)) for n, leaf, _ in chosen]
    return hashlib.sha256(json.dumps(plan).encode()).hexdigest()[:16]


def _fingerprint(reader: Any) -> dict[str, str]:
    """What `reader` opened, the same on every process that opened the same save: its name
    and a digest of its metadata (a `.shards` index cites its save's unique piece files; a
    file's metadata holds its step and its tensors' checksums)."""
    metadata = json.dumps(getattr(reader, "metadata", {}), sort_keys=True)
    digest = hashlib.sha256(metadata.encode()).hexdigest()[:16]
    return {"name": os.path.basename(str(reader.path).rstrip("/" + os.sep)), "digest": digest}


def _identity(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    return arrays


def place(reader: Any, leaves: Sequence[tuple[str, Any]], verify: bool) -> dict[str, jax.Array]:
    """The target leaves (name, leaf) that a read-once restore places, read and assembled
    in their target shardings; the others are left out (read block by block by the caller).

    **Returns:**

    The placed arrays by name; `{}` (with a warning) when a peer did not arrive within
    `TIMEOUT_S`, or arrived with other leaves to read once (another restore call), so that
    the caller reads every leaf block by block.

    **Raises:**

    On the process whose reads failed, its own error; on the others, naming that process,
    `CheckpointFormatError` (a corrupt piece), `FileNotFoundError` (the checkpoint was
    replaced meanwhile: the caller looks again) or `RuntimeError`. On every process,
    `FileNotFoundError` when the processes opened different checkpoints (a save landed
    between their listings): the caller looks again.
    """
    chosen = [(n, leaf, s) for n, leaf in leaves if (s := staging_sharding(leaf)) is not None]
    if not chosen:
        return {}
    staged: list[jax.Array] = []
    failure: BaseException | None = None
    try:
        staged = [_read_staged(reader, n, leaf, s, verify) for n, leaf, s in chosen]
        status: dict[str, Any] = {"ok": True, "read": _fingerprint(reader)}
    except Exception as error:  # reported to the others, then raised here
        failure = error
        kind = "gone" if isinstance(error, FileNotFoundError) else "other"
        kind = "format" if isinstance(error, CheckpointFormatError) else kind
        status = {"kind": kind, "error": f"{type(error).__name__}: {error}"[:2000]}
    status["plan"] = _plan_digest(chosen)
    try:
        answers = _exchange(json.dumps(status))
    except _coordination.BarrierTimeoutError as error:
        if failure is not None:
            raise failure from None
        return _fall_back(staged, f"{error}", reader)
    if failure is not None:
        raise failure
    reports = [json.loads(r) for r in answers]
    if len({r["plan"] for r in reports}) > 1:
        # Two different calls met (a process that came late skipped ahead, see `_exchange`,
        # and met its peer's next restore): no resharding between them.
        return _fall_back(staged, "the processes were restoring different leaves.", reader)
    failed = [(i, r) for i, r in enumerate(reports) if not r.get("ok")]
    if failed:
        i, report = failed[0]
        why = f"process {i} could not read its share of it ({report['error']})"
        if report["kind"] == "gone":
            raise FileNotFoundError(
                f"{call('restore_checkpoint')}: {reader.path} changed while read: {why}"
            )
        if report["kind"] == "format":
            raise reader.bad(why)
        raise RuntimeError(
            f"{call('restore_checkpoint')}: the restore of {reader.path} failed: {why}."
        )
    read = [r["read"] for r in reports]
    if len({(r["name"], r["digest"]) for r in read}) > 1:
        # Each process opened its own checkpoint (a save landed between their listings, or
        # an overwrite between their opens): the runs of one block must all come from one.
        for array in staged:
            array.delete()
        listed = ", ".join(f"process {i}: {r['name']} ({r['digest']})" for i, r in enumerate(read))
        raise FileNotFoundError(
            f"{call('restore_checkpoint')}: the processes opened different checkpoints "
            f"({listed}; the digest is "
            "of each one's metadata), so their shares of one array cannot be assembled; "
            "looking again. Every process must restore the same checkpoint."
        )
    targets = tuple(leaf.sharding for _, leaf, _ in chosen)
    placed = jax.jit(_identity, out_shardings=targets)(*staged)
    for array in staged:
        array.delete()  # the runs: the assembled blocks hold the bytes now
    return {n: array for (n, _, _), array in zip(chosen, placed, strict=True)}
