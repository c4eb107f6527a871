"""Multi-process saves on `jax.distributed`: which pieces each process writes, and the
commit protocol. (`_shards` describes the layout and reads it back.)

A `.shards` directory (on an object store: the key prefix) counts as a checkpoint only once
its index exists. The index is written last, by process 0, atomically (a temporary file
renamed over the old index; on an object store, one upload that appears whole): an
overwrite switches from the old pieces to the new ones in one step, so a crash leaves the
old checkpoint or the new one, never neither.

The processes synchronise through the coordination service `jax.distributed` runs (see
`_coordination`), never through files: no step needs a shared POSIX directory.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import jax
else:  # imported on first use: the command line reads headers without JAX
    from ..._lazy import LazyModule

    jax = LazyModule("jax")

from ..._calls import call
from .._errors import StepExistsError
from ..format import _description, _format, _header_codes, _names, _shards
from ..format._names import PIECES_KEY
from ..format._reader import FileReader
from ..storage._base import Storage
from . import _agreement, _coordination
from ._coordination import BarrierTimeoutError as BarrierTimeoutError

_COMMITTED = "committed"
# The start of process 0's answer when its index write failed without a refusal: the index
# may be committed, or land later, so no process may delete its pieces.
_UNSURE = "outcome unknown: "


def begin_save() -> int:
    """The number of this save: the first thing a multi-process save does, before anything
    that can fail, so that it is the same on every process (see
    `_coordination.next_number`). Every exchange of the save is keyed by it."""
    return _coordination.next_number("save")


def save_key(number: int, step_text: str) -> str:
    """The key of a save's later exchanges: its number and its step, both agreed."""
    return f"{number}@{step_text}"


def agree_on_token(
    number: int,
    plan: tuple[str, str, Any, list[_description.Tensor]] | BaseException,
    *,
    timeout_s: int | float,
) -> str:
    """The opening exchange of save `number`: every process reports whether it could
    prepare the save (`plan` is `(step_text, prefix, description, tensors)`, or the error
    that stopped it) and a digest of what it is about to save; process 0 adds the save's
    token (it names process 0 as the writer).

    **Returns:**

    The token, the same on every process.

    **Raises:**

    On every process, before anything is written: the process's own error if it failed;
    a `RuntimeError` naming the processes that failed; a `ValueError` naming the first
    difference if the processes disagree on the step, the prefix or the tree (leaf names,
    dtypes, global shapes, shardings, which leaves are host-local, the tree's structure).
    """
    process = jax.process_index()
    op = _coordination.op_id("save_open", str(number))
    if isinstance(plan, BaseException):
        mine: dict[str, Any] = {"failed": f"{type(plan).__name__}: {plan}"[:2000]}
        layout = None
    else:
        step_text, prefix, description, tensors = plan
        layout = _agreement.layout_of(description, tensors)
        mine = {
            "step": step_text,
            "prefix": prefix,
            "digest": hashlib.sha256(_agreement.canonical(layout).encode()).hexdigest(),
        }
        if process == 0:
            mine["token"] = _names.new_token()
    reports = [
        json.loads(r) for r in _coordination.gather(op, json.dumps(mine), timeout_s=timeout_s)
    ]
    if isinstance(plan, BaseException):
        raise plan
    failed = [f"process {i} ({r['failed']})" for i, r in enumerate(reports) if "failed" in r]
    if failed:
        raise RuntimeError(
            f"{call()}: the save was abandoned before anything was written because "
            f"{', '.join(failed)} could not begin it; the previous checkpoint is still the "
            "latest."
        )
    for field in ("step", "prefix"):
        values = [r[field] for r in reports]
        if len(set(values)) > 1:
            listed = ", ".join(f"process {i}: {v!r}" for i, v in enumerate(values))
            raise ValueError(
                f"{call()}: the processes disagree on the {field} ({listed}), so nothing was "
                "written. Every process must make the same save call."
            )
    if len({r["digest"] for r in reports}) > 1:
        # Rare, and then worth a second exchange: every layout, to name the difference.
        assert layout is not None
        layouts = _coordination.gather(
            _coordination.op_id("save_layouts", str(number)),
            _agreement.canonical(layout),
            timeout_s=timeout_s,
        )
        difference = _agreement.first_difference([json.loads(text) for text in layouts])
        raise ValueError(
            f"{call()}: the processes disagree on what to save, so nothing was written: "
            f"{difference}. Every process must pass the same tree (the same leaf names, "
            "dtypes, global shapes and shardings)."
        )
    return reports[0]["token"]


def plan_pieces(
    tensors: list[_description.Tensor], process: int, *, replica_parallel: bool = True
) -> tuple[list[_description.Tensor], dict[str, dict[str, Any]]]:
    """The pieces process `process` writes, and for each its leaf and slice.

    With `replica_parallel` (the default), the processes holding a replica of one block of
    a global array cut it into contiguous runs along one axis (`_shards.split_axis`), one
    per process, each written by its own process: a block replicated on R processes costs
    each of them 1/R of its bytes. Who writes what follows from the array's sharding alone,
    which every process knows and the opening exchange checked to be the same everywhere,
    so no further coordination is needed. Without it, each block is written whole by the
    device with `replica_id == 0` (the layout of earlier versions; both read the same).
    Host-local leaves are written whole by process 0 either way."""
    pieces: list[_description.Tensor] = []
    where: dict[str, dict[str, Any]] = {}
    for tensor in tensors:
        source = tensor.source
        if isinstance(source, jax.Array) and not source.is_fully_addressable:
            plan = _replica_runs if replica_parallel else _replica_zero_blocks
            mine = plan(source, tensor.shape, process, tensor.owned)
        else:
            whole = [[0, d] for d in tensor.shape]
            mine = [(whole, tensor.get, tensor.source, tensor.owned)] if process == 0 else []
        for k, (ranges, get, data, owned) in enumerate(mine):
            name = _names.piece_tensor(tensor.name, process, k)
            shape = tuple(b - a for a, b in ranges)
            # The shard itself as the source: the writer starts its transfer ahead of time.
            pieces.append(_description.Tensor(name, get, tensor.dtype, shape, data, owned))
            where[name] = {"leaf": tensor.name, "index": ranges}
    return pieces, where


_Run = tuple[list[list[int]], Callable[[], np.ndarray], Any, bool]


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(d)[:2] for s, d in zip(index, shape, strict=True))


def _replica_zero_blocks(
    array: jax.Array, shape: tuple[int, ...], process: int, owned: bool
) -> list[_Run]:
    return [
        (
            [list(b) for b in _bounds(shard.index, shape)],
            lambda d=shard.data: np.asarray(d),
            shard.data,
            owned,
        )
        for shard in array.addressable_shards
        if shard.replica_id == 0
    ]


def _replica_runs(
    array: jax.Array, shape: tuple[int, ...], process: int, owned: bool
) -> list[_Run]:
    """This process's runs of the blocks of `array` (see `plan_pieces`). One axis is cut
    for the whole array, chosen from its smallest block, so that the pieces form a grid
    (as `_shards.validate_arrays` requires) even when the blocks are uneven."""
    holders: dict[tuple[tuple[int, int], ...], set[int]] = {}
    for device, index in array.sharding.devices_indices_map(shape).items():
        holders.setdefault(_bounds(index, shape), set()).add(device.process_index)
    local: dict[tuple[tuple[int, int], ...], Any] = {}
    for shard in array.addressable_shards:
        local.setdefault(_bounds(shard.index, shape), shard.data)
    counts = {len(p) for p in holders.values()}
    parts = counts.pop() if len(counts) == 1 else 0  # uneven replication: whole blocks
    smallest = [min(b[a][1] - b[a][0] for b in holders) for a in range(len(shape))]
    axis = _shards.split_axis(smallest, parts)
    runs: list[_Run] = []
    for bounds in sorted(holders):
        order = sorted(holders[bounds])
        if process not in order:
            continue
        data = local[bounds]
        if axis is None:  # written whole, by the first process holding it
            if order[0] == process:
                runs.append(([list(b) for b in bounds], lambda d=data: np.asarray(d), data, owned))
            continue
        ranges = _shards.split_bounds(bounds, axis, order.index(process), parts)
        # A copy of just this run on the device: only its bytes travel to the host.
        run = data[
            tuple(slice(lo - b[0], hi - b[0]) for (lo, hi), b in zip(ranges, bounds, strict=True))
        ]
        runs.append((ranges, lambda d=run: np.asarray(d), run, True))
    return runs


def write_and_commit(
    store: Storage,
    final_dir: str,
    token: str,
    key: str,
    planned: tuple[list[_description.Tensor], dict[str, dict[str, Any]]] | BaseException,
    tensors: list[_description.Tensor],
    metadata: dict[str, str],
    *,
    timeout_s: int | float,
    overwrite: bool,
    after_commit: Callable[[], None],
) -> None:
    """Every process uploads its piece file and reports; when all pieces are durable,
    process 0 writes the index (the commit), drops the replaced pieces, runs `after_commit`
    (retention), and tells the others whether it committed.

    `key` (from `save_key`) names this save's exchanges; `planned` is this process's
    `plan_pieces` result, or the error that stopped it (reported like a failed write, so
    the others give up at once)."""
    process, count = jax.process_index(), jax.process_count()
    own_piece = store.join(final_dir, _names.piece_file(process, token))
    every_piece = [store.join(final_dir, _names.piece_file(i, token)) for i in range(count)]
    outcome = _Outcome()
    try:
        status, failure = _write_piece(store, final_dir, own_piece, token, planned)
        statuses = _coordination.gather(
            _coordination.op_id("save_written", key), status, timeout_s=timeout_s
        )
        if failure is not None:
            raise failure
        failed = [f"process {i} ({s})" for i, s in enumerate(statuses) if s != "ok"]
        if failed:
            raise RuntimeError(
                f"{call()}: the save was abandoned because {', '.join(failed)} could not "
                "write its pieces; the previous checkpoint is still the latest."
            )
        # Every process that got here makes this call; process 0 always answers.
        commit_op = _coordination.op_id("save_commit", key)
        if process != 0:
            _hear_commit(commit_op, timeout_s, outcome)
            return
        replaced = _write_index(
            store, final_dir, token, tensors, metadata, commit_op, timeout_s, overwrite, outcome
        )
        try:
            _shards.remove_replaced_pieces(
                store, final_dir, replaced, {_names.piece_file(i, token) for i in range(count)}
            )
            after_commit()
        finally:
            # Only now: the peers return seeing the same checkpoints as process 0.
            _coordination.broadcast(commit_op, _COMMITTED, timeout_s=timeout_s)
    except BaseException as error:
        if outcome.committed or outcome.unsure:
            raise  # an index that may land cites these pieces: cleanup removes them later
        # This save will never commit: take back what it wrote (process 0: every
        # process's pieces of this token), so no uncommitted litter stays behind.
        _shards.remove_paths(store, every_piece if process == 0 else [own_piece])
        _shards.remove_if_uncommitted_and_empty(store, final_dir)
        if isinstance(error, BarrierTimeoutError):
            raise BarrierTimeoutError(
                f"{error} Nothing was committed: the previous checkpoint is still the latest."
            ) from None
        raise


@dataclass
class _Outcome:
    """What this process knows of the commit: done, or possibly done (an index that may be
    committed, or land later), in which case no process may delete its pieces."""

    committed: bool = False
    unsure: bool = False


def _write_piece(
    store: Storage,
    final_dir: str,
    own_piece: str,
    token: str,
    planned: tuple[list[_description.Tensor], dict[str, dict[str, Any]]] | BaseException,
) -> tuple[str, BaseException | None]:
    """Writes this process's piece file: ("ok", None), or the status to report and the
    error to raise once it is reported."""
    try:
        if isinstance(planned, BaseException):
            raise planned
        pieces, where = planned
        store.makedirs(final_dir)
        # The piece names its save and its writer, so that a reader can tell it from a
        # piece of any other save (or process) copied under the name the index cites.
        piece_metadata = {
            PIECES_KEY: json.dumps(where),
            _names.SAVE_KEY: token,
            _names.PROCESS_KEY: str(jax.process_index()),
        }
        store.atomic_write(own_piece, lambda out: _format.write_file(out, pieces, piece_metadata))
    except Exception as error:  # reported to the others, then raised here
        return f"{type(error).__name__}: {error}", error
    return "ok", None


def _hear_commit(commit_op: str, timeout_s: int | float, outcome: _Outcome) -> None:
    """A process other than 0: waits for process 0's word on the commit; raises unless it
    committed."""
    said = _coordination.broadcast(commit_op, None, timeout_s=timeout_s)
    outcome.unsure = str(said).startswith(_UNSURE)
    if said != _COMMITTED:
        # Process 0 was refused because another save's index is there: the same error here.
        error = StepExistsError if str(said).startswith(StepExistsError.__name__) else RuntimeError
        raise error(
            f"{call()}: process 0 did not commit this save ({said}); the previous "
            "checkpoint is still the latest."
        )
    outcome.committed = True


def _write_index(
    store: Storage,
    final_dir: str,
    token: str,
    tensors: list[_description.Tensor],
    metadata: dict[str, str],
    commit_op: str,
    timeout_s: int | float,
    overwrite: bool,
    outcome: _Outcome,
) -> set[str]:
    """Process 0's commit: the index citing every process's pieces, written atomically.
    Returns the pieces of the index it replaced; on failure, tells the
    others why (and whether the index may land after all) before raising."""
    try:
        arrays = _collect_index(store, final_dir, token, jax.process_count(), tensors)
        replaced = _shards.referenced_pieces(store, final_dir, FileReader) or set()
        index_metadata = {
            **_header_codes.with_complex(metadata, [t.dtype for t in tensors]),
            _names.ARRAYS_KEY: json.dumps(arrays, separators=(",", ":")),
            _names.SAVE_KEY: token,
        }
        try:
            store.atomic_write(
                store.join(final_dir, _names.INDEX_NAME),
                lambda out: _format.write_file(out, [], index_metadata),
                replace=overwrite,
            )
        except Exception as refusal:
            # Refused because the index exists (a concurrent save's, or ours, committed
            # by a request whose answer was lost and whose retry was refused), or no
            # answer at all: the index may be ours, or may still land. Ours cites only
            # this save's pieces; unless the store shows another save's index, they stay.
            whose = _index_owner(store, final_dir, token)
            if whose != "ours":
                outcome.unsure = whose == "unknown" or not isinstance(refusal, FileExistsError)
                if whose == "other" and isinstance(refusal, FileExistsError):
                    raise StepExistsError(
                        f"{call()}: a checkpoint was committed at {final_dir} by another save "
                        "while this one was writing; it was kept. Pass overwrite=True to "
                        "replace it."
                    ) from None
                raise
    except BaseException as error:
        _coordination.broadcast(
            commit_op,
            (_UNSURE if outcome.unsure else "") + f"{type(error).__name__}: {error}",
            timeout_s=timeout_s,
        )
        raise
    outcome.committed = True
    return replaced


def _index_owner(store: Storage, final_dir: str, token: str) -> str:
    """Whose index `final_dir` holds: "ours" (it cites only the pieces of save `token`),
    "other" (another save's, or none), or "unknown" (it could not be read)."""
    index = store.join(final_dir, _names.INDEX_NAME)
    try:
        with FileReader(index, store.open(index)) as reader:
            arrays = json.loads(reader.metadata[_names.ARRAYS_KEY])
        cited = {piece["file"] for entry in arrays.values() for piece in entry["pieces"]}
    except FileNotFoundError:
        return "other"
    except Exception:
        # The store did not answer, or the bytes read do not parse (a read cut short looks
        # like a corrupt file): keeping pieces is always safe, deleting them is not.
        return "unknown"
    tokens = {(_names.parse_piece_file(name) or (0, None))[1] for name in cited}
    return "ours" if tokens == {token} else "other"


def _collect_index(
    store: Storage,
    final_dir: str,
    token: str,
    count: int,
    tensors: list[_description.Tensor],
) -> dict[str, dict[str, Any]]:
    arrays: dict[str, dict[str, Any]] = {
        t.name: {
            "shape": list(t.shape),
            "dtype": _description.dtype_code(t.dtype, t.name),
            "pieces": [],
        }
        for t in tensors
    }
    for i in range(count):
        file_name = _names.piece_file(i, token)
        path = store.join(final_dir, file_name)
        with FileReader(path, store.open(path)) as reader:
            where = json.loads(reader.metadata[PIECES_KEY])
        for tensor_name, piece in where.items():
            arrays[piece["leaf"]]["pieces"].append(
                {"file": file_name, "tensor": tensor_name, "index": piece["index"]}
            )
    # The reader's own check, before the commit: each array tiled by its pieces exactly
    # once (a shard with no owner, or with two, would commit an unreadable checkpoint).
    return _shards.validate_arrays(
        arrays, lambda why: RuntimeError(f"{call()}: the processes' pieces do not fit: {why}.")
    )
