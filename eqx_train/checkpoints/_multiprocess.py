"""Multi-process saves on `jax.distributed`: which pieces each process writes, and the
commit protocol. (`_shards` reads the layout back.)

Layout of a `.shards` checkpoint (see docs/checkpoint_format.md):

    {prefix}{step}.shards/
        index.safetensors                      the commit: no tensors; metadata holds the
                                               tree, step, and every array's pieces
        process_00000.{token}.safetensors      the pieces process 0 owns (plain safetensors)
        process_00001.{token}.safetensors      ...

The directory (on an object store: the key prefix) counts as a checkpoint only once its
index exists. The index is written last, by process 0, atomically (a temporary file renamed
over the old index; on an object store, one upload that appears whole): an overwrite
switches from the old pieces to the new ones in one step, so a crash leaves the old
checkpoint or the new one, never neither.

The processes synchronise through the coordination service `jax.distributed` runs (see
`_coordination`), never through files: no step needs a shared POSIX directory.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import jax
else:  # imported on first use: the command line reads headers without JAX
    from .._lazy import LazyModule

    jax = LazyModule("jax")

from . import _coordination, _description, _directory, _format, _names, _shards
from ._coordination import BarrierTimeoutError as BarrierTimeoutError
from ._names import PIECES_KEY
from ._storage import Storage

_COMMITTED = "committed"


def agree_on_token(timeout_s: int | float, caller: str) -> str:
    """A save token chosen by process 0 (it names process 0 as the writer), the same on
    every process."""
    mine = _names.new_token() if jax.process_index() == 0 else None
    op = _coordination.next_id("save_token")
    return _coordination.broadcast(op, mine, timeout_s=timeout_s, caller=caller)


def plan_pieces(
    tensors: list[_description.Tensor], process: int
) -> tuple[list[_description.Tensor], dict[str, dict[str, Any]]]:
    """The pieces process `process` writes, and for each its leaf and slice. Each shard of
    a global array is written once (by the device with `replica_id == 0`); host-local
    leaves are written whole by process 0."""
    pieces: list[_description.Tensor] = []
    where: dict[str, dict[str, Any]] = {}
    for tensor in tensors:
        source = tensor.source
        if isinstance(source, jax.Array) and not source.is_fully_addressable:
            mine = [
                (
                    [
                        list(s.indices(d)[:2])
                        for s, d in zip(shard.index, tensor.shape, strict=True)
                    ],
                    lambda data=shard.data: np.asarray(data),
                    shard.data,
                )
                for shard in source.addressable_shards
                if shard.replica_id == 0
            ]
        else:
            whole = [[0, d] for d in tensor.shape]
            mine = [(whole, tensor.get, tensor.source)] if process == 0 else []
        for k, (ranges, get, data) in enumerate(mine):
            name = _names.piece_tensor(tensor.name, process, k)
            shape = tuple(b - a for a, b in ranges)
            # The shard itself as the source: the writer starts its transfer ahead of time.
            pieces.append(_description.Tensor(name, get, tensor.dtype, shape, data, tensor.owned))
            where[name] = {"leaf": tensor.name, "index": ranges}
    return pieces, where


def write_and_commit(
    store: Storage,
    final_dir: str,
    token: str,
    pieces: list[_description.Tensor],
    where: dict[str, dict[str, Any]],
    tensors: list[_description.Tensor],
    metadata: dict[str, str],
    *,
    timeout_s: int | float,
    caller: str,
    overwrite: bool,
    after_commit: Callable[[], None],
) -> None:
    """Every process uploads its piece file and reports; when all pieces are durable,
    process 0 writes the index (the commit), drops the replaced pieces, runs `after_commit`
    (retention), and tells the others whether it committed."""
    process, count = jax.process_index(), jax.process_count()
    own_piece = store.join(final_dir, _names.piece_file(process, token))
    every_piece = [store.join(final_dir, _names.piece_file(i, token)) for i in range(count)]
    committed = False
    try:
        try:
            store.makedirs(final_dir)
            store.atomic_write(
                own_piece,
                lambda out: _format.write_file(out, pieces, {PIECES_KEY: json.dumps(where)}),
            )
            status = "ok"
        except Exception as error:  # reported to the others, then raised here
            status = f"{type(error).__name__}: {error}"
            failure: BaseException | None = error
        else:
            failure = None
        statuses = _coordination.gather(
            _coordination.next_id("save_written"), status, timeout_s=timeout_s, caller=caller
        )
        if failure is not None:
            raise failure
        failed = [f"process {i} ({s})" for i, s in enumerate(statuses) if s != "ok"]
        if failed:
            raise RuntimeError(
                f"{caller}: the save was abandoned because {', '.join(failed)} could not "
                "write its pieces; the previous checkpoint is still the latest."
            )
        # Every process that got here makes this call; process 0 always answers.
        commit_op = _coordination.next_id("save_commit")
        if process != 0:
            outcome = _coordination.broadcast(commit_op, None, timeout_s=timeout_s, caller=caller)
            if outcome != _COMMITTED:
                raise RuntimeError(
                    f"{caller}: process 0 did not commit this save ({outcome}); the previous "
                    "checkpoint is still the latest."
                )
            committed = True
            return
        try:
            arrays = _collect_index(store, final_dir, token, count, tensors, caller)
            replaced = _shards.referenced_pieces(store, final_dir) or set()
            index_metadata = {
                **metadata,
                _names.ARRAYS_KEY: json.dumps(arrays, separators=(",", ":")),
            }
            try:
                store.atomic_write(
                    store.join(final_dir, _names.INDEX_NAME),
                    lambda out: _format.write_file(out, [], index_metadata),
                    replace=overwrite,
                )
            except FileExistsError:
                # The store refused the index because it exists: a concurrent save's, or
                # ours, committed by a request whose answer was lost before the client's
                # retry was refused. Ours cites only this save's pieces.
                cited = _shards.referenced_pieces(store, final_dir) or set()
                tokens = {(_names.parse_piece_file(name) or (0, None))[1] for name in cited}
                if tokens != {token}:
                    raise
        except BaseException as error:
            _coordination.broadcast(
                commit_op,
                f"{type(error).__name__}: {error}",
                timeout_s=timeout_s,
                caller=caller,
            )
            raise
        committed = True
        try:
            _directory.remove_replaced_pieces(
                store, final_dir, replaced, {_names.piece_file(i, token) for i in range(count)}
            )
            after_commit()
        finally:
            # Only now: the peers return seeing the same checkpoints as process 0.
            _coordination.broadcast(commit_op, _COMMITTED, timeout_s=timeout_s, caller=caller)
    except BaseException as error:
        if committed:
            raise
        # This save will never commit: take back what it wrote (process 0: every
        # process's pieces of this token), so no uncommitted litter stays behind.
        _directory.remove_paths(store, every_piece if process == 0 else [own_piece])
        _directory.remove_if_uncommitted_and_empty(store, final_dir)
        if isinstance(error, BarrierTimeoutError):
            raise BarrierTimeoutError(
                f"{error} Nothing was committed: the previous checkpoint is still the latest."
            ) from None
        raise


def _collect_index(
    store: Storage,
    final_dir: str,
    token: str,
    count: int,
    tensors: list[_description.Tensor],
    caller: str,
) -> dict[str, dict[str, Any]]:
    arrays: dict[str, dict[str, Any]] = {
        t.name: {
            "shape": list(t.shape),
            "dtype": _description.dtype_code(t.dtype, t.name, caller),
            "pieces": [],
        }
        for t in tensors
    }
    for i in range(count):
        file_name = _names.piece_file(i, token)
        path = store.join(final_dir, file_name)
        with _format.FileReader(path, store.open(path)) as reader:
            where = json.loads(reader.metadata[PIECES_KEY])
        for tensor_name, piece in where.items():
            arrays[piece["leaf"]]["pieces"].append(
                {"file": file_name, "tensor": tensor_name, "index": piece["index"]}
            )
    for leaf, entry in arrays.items():
        covered = sum(math.prod(b - a for a, b in p["index"]) for p in entry["pieces"])
        if covered != math.prod(entry["shape"]) or (not entry["shape"] and not entry["pieces"]):
            raise RuntimeError(
                f"{caller}: the processes wrote {covered} of {math.prod(entry['shape'])} "
                f"elements of '{leaf}'; some shard has no owner."
            )
    return arrays
