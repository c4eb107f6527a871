"""Multi-process checkpoints on `jax.distributed`: which pieces each process writes, the
commit protocol, and the reader that assembles any block of an array from the pieces.

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

from . import _coordination, _files, _format, _names
from ._coordination import BarrierTimeoutError as BarrierTimeoutError
from ._storage import Storage

PIECES_KEY = "eqx_train.pieces"
_MAX_PIECES = 1 << 20
_COMMITTED = "committed"


def agree_on_token(timeout_s: int | float, caller: str) -> str:
    """A save token chosen by process 0 (it names process 0 as the writer), the same on
    every process."""
    mine = _names.new_token() if jax.process_index() == 0 else None
    op = _coordination.next_id("save_token")
    return _coordination.broadcast(op, mine, timeout_s=timeout_s, caller=caller)


def plan_pieces(
    tensors: list[_format.Tensor], process: int
) -> tuple[list[_format.Tensor], dict[str, dict[str, Any]]]:
    """The pieces process `process` writes, and for each its leaf and slice. Each shard of
    a global array is written once (by the device with `replica_id == 0`); host-local
    leaves are written whole by process 0."""
    pieces: list[_format.Tensor] = []
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
            name = f"{tensor.name}#{process}.{k}"
            shape = tuple(b - a for a, b in ranges)
            # The shard itself as the source: the writer starts its transfer ahead of time.
            pieces.append(_format.Tensor(name, get, tensor.dtype, shape, data, tensor.owned))
            where[name] = {"leaf": tensor.name, "index": ranges}
    return pieces, where


def write_and_commit(
    store: Storage,
    final_dir: str,
    token: str,
    pieces: list[_format.Tensor],
    where: dict[str, dict[str, Any]],
    tensors: list[_format.Tensor],
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
            replaced = _files.referenced_pieces(store, final_dir) or set()
            index_metadata = {
                **metadata,
                _format.ARRAYS_KEY: json.dumps(arrays, separators=(",", ":")),
            }
            store.atomic_write(
                store.join(final_dir, _names.INDEX_NAME),
                lambda out: _format.write_file(out, [], index_metadata),
                replace=overwrite,
            )
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
            _files.remove_replaced_pieces(
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
        _files.remove_paths(store, every_piece if process == 0 else [own_piece])
        _files.remove_if_uncommitted_and_empty(store, final_dir)
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
    tensors: list[_format.Tensor],
    caller: str,
) -> dict[str, dict[str, Any]]:
    arrays: dict[str, dict[str, Any]] = {
        t.name: {
            "shape": list(t.shape),
            "dtype": _format.dtype_code(t.dtype, t.name, caller),
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


# ------------------------------------------------------------------------------------ restore


def is_sharded_checkpoint(store: Storage, path: str) -> bool:
    return store.is_dir(path) and store.is_file(store.join(path, _names.INDEX_NAME))


def _validate_arrays(raw: Any, bad: Callable[[str], Exception]) -> dict[str, dict[str, Any]]:
    """Checks a whole index before anything is opened or allocated: names, dtypes, shapes,
    piece files (plain names of this library's form, never a path), and that each array's
    pieces lie inside it and tile it exactly once."""
    if not isinstance(raw, dict):
        raise bad("its array table is not a JSON object")
    total_pieces = 0
    for name, entry in raw.items():
        where = f"array {_format.short(name)}"
        if not isinstance(entry, dict) or set(entry) != {"shape", "dtype", "pieces"}:
            raise bad(f"{where} has a malformed entry")
        shape, code, pieces = entry["shape"], entry["dtype"], entry["pieces"]
        if not isinstance(code, str) or code not in _format.CODE_TO_DTYPE:
            raise bad(f"{where} has unsupported dtype {_format.short(code)}")
        if not (
            isinstance(shape, list)
            and len(shape) <= _format.MAX_NDIM
            and all(type(s) is int and s >= 0 for s in shape)
        ):
            raise bad(f"{where} has an invalid shape {_format.short(shape)}")
        if not isinstance(pieces, list) or not pieces:
            raise bad(f"{where} has no pieces")
        total_pieces += len(pieces)
        if total_pieces > _MAX_PIECES:
            raise bad(f"the index lists more than {_MAX_PIECES} pieces")
        boxes = []
        for piece in pieces:
            if not isinstance(piece, dict) or set(piece) != {"file", "tensor", "index"}:
                raise bad(f"{where} has a malformed piece {_format.short(piece)}")
            file, tensor, ranges = piece["file"], piece["tensor"], piece["index"]
            if not isinstance(file, str) or _names.parse_piece_file(file) is None:
                raise bad(f"{where} cites the file {_format.short(file)}, not a piece file name")
            if not isinstance(tensor, str):
                raise bad(f"{where} has a piece with tensor name {_format.short(tensor)}")
            if not (
                isinstance(ranges, list)
                and len(ranges) == len(shape)
                and all(
                    isinstance(r, list)
                    and len(r) == 2
                    and all(type(v) is int for v in r)
                    and 0 <= r[0] <= r[1] <= d
                    for r, d in zip(ranges, shape, strict=False)
                )
            ):
                raise bad(f"{where} has a piece with invalid bounds {_format.short(ranges)}")
            boxes.append(ranges)
        volume = sum(math.prod(b - a for a, b in box) for box in boxes)
        if volume != math.prod(shape) or (not shape and len(boxes) != 1):
            raise bad(f"{where}: its pieces hold {volume} of its {math.prod(shape)} elements")
        _check_tiling(boxes, where, bad)
    cited = [(p["file"], p["tensor"]) for e in raw.values() for p in e["pieces"]]
    if len(set(cited)) != len(cited):
        raise bad("the index cites one piece for two places")
    return raw


def _check_tiling(
    boxes: list[list[list[int]]], where: str, bad: Callable[[str], Exception]
) -> None:
    """The non-empty pieces are the cells of one grid (per-axis cut points), each cell once:
    with the volume check, they tile the array. O(n log n), as the pieces of any sharding
    are such a grid."""
    boxes = [b for b in boxes if all(lo < hi for lo, hi in b)]
    if not boxes or not boxes[0]:
        return  # an empty array, or a scalar: one piece, checked by the caller
    cuts = [sorted({v for box in boxes for v in box[axis]}) for axis in range(len(boxes[0]))]
    if math.prod(len(c) - 1 for c in cuts) != len(boxes):
        raise bad(f"{where}: its pieces do not form a grid over the array")
    position = [{v: i for i, v in enumerate(c)} for c in cuts]
    cells = set()
    for box in boxes:
        cell = tuple(position[axis][lo] for axis, (lo, _) in enumerate(box))
        if any(
            position[axis][hi] != i + 1
            for axis, ((_, hi), i) in enumerate(zip(box, cell, strict=True))
        ):
            raise bad(f"{where}: a piece {box} spans several cells of the grid")
        cells.add(cell)
    if len(cells) != len(boxes):
        raise bad(f"{where} has overlapping pieces")


class ShardedReader:
    """A `.shards` checkpoint as one reader: its index (validated whole first), then any
    block of any array, read only from the pieces that overlap it."""

    def __init__(self, store: Storage, directory: str):
        self.path = directory
        self.store = store
        index = store.join(directory, _names.INDEX_NAME)
        self.index = _format.FileReader(index, store.open(index))
        self._files: dict[str, _format.FileReader] = {}
        self._records: dict[str, dict[str, Any]] = {}
        self._checked: set[tuple[str, str]] = set()
        try:
            raw = self.index.metadata.get(_format.ARRAYS_KEY)
            if raw is None:
                raise self.bad("its index has no array table")
            self._arrays = _validate_arrays(
                _format.parse_json(raw, "the array table", self.bad), self.bad
            )
            self.metadata = self.index.metadata
            # Locally, open (and so pin) every piece file now: an overwrite that commits
            # meanwhile cannot pull them away, and each header is checked against the index.
            # On an object store each open is a request: pieces are opened (and checked)
            # when first read, so a host fetches only the pieces its devices need.
            for name, entry in self._arrays.items() if store.is_local else ():
                for piece in entry["pieces"]:
                    self._piece(name, piece)
        except BaseException:
            self.close()
            raise
        # Built once: every block read looks its array up here.
        self._shapes = {
            name: (tuple(e["shape"]), _format.CODE_TO_DTYPE[e["dtype"]])
            for name, e in self._arrays.items()
        }
        self._cache: dict[tuple[str, str], np.ndarray] = {}
        self._cached_for: str | None = None
        self._description: Any = None

    def bad(self, why: str) -> _format.CheckpointFormatError:
        return _format.CheckpointFormatError(f"{self.path} is not a valid checkpoint: {why}.")

    def _piece(self, name: str, piece: dict[str, Any]) -> _format.FileReader:
        """The open piece file of `piece` (of array `name`), checked once against the index:
        the piece file's own record of the piece must match."""
        reader = self._file(piece["file"])
        key = (piece["file"], piece["tensor"])
        if key not in self._checked:
            dtype = _format.CODE_TO_DTYPE[self._arrays[name]["dtype"]]
            info = reader.tensors.get(piece["tensor"])
            extents = tuple(b - a for a, b in piece["index"])
            own = self._own_records(piece["file"]).get(piece["tensor"])
            if (
                info is None
                or info.dtype != dtype
                or info.shape != extents
                or own != {"leaf": name, "index": piece["index"]}
            ):
                raise self.bad(
                    f"array {_format.short(name)}: piece {_format.short(piece['tensor'])} is "
                    f"not in {piece['file']} as {dtype}{list(extents)}"
                )
            self._checked.add(key)
        return reader

    def _index_replaced(self) -> bool:
        now = self.store.identity(self.store.join(self.path, _names.INDEX_NAME))
        return now != self.index.source.identity

    def _file(self, name: str) -> _format.FileReader:
        if name not in self._files:
            path = self.store.join(self.path, name)
            try:
                self._files[name] = _format.FileReader(path, self.store.open(path))
            except FileNotFoundError:
                if self._index_replaced():
                    raise  # an overwrite or retention came after we opened the index: retry
                raise self.bad(f"the piece file {name} it cites is missing") from None
        return self._files[name]

    def check_unchanged(self) -> None:
        """Raises `ObjectReplacedError` if the index or a piece read was replaced since it
        was opened (see `FileReader.check_unchanged`)."""
        for reader in [self.index, *self._files.values()]:
            reader.check_unchanged()

    def __enter__(self) -> ShardedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.index.close()
        for reader in self._files.values():
            reader.close()

    def _own_records(self, file: str) -> dict[str, Any]:
        """What a piece file says of its own pieces (leaf and slice), to cross-check the index."""
        if file not in self._records:
            raw = self._file(file).metadata.get(PIECES_KEY, "{}")
            records = _format.parse_json(raw, f"the piece table of {file}", self.bad)
            self._records[file] = records if isinstance(records, dict) else {}
        return self._records[file]

    @property
    def has_description(self) -> bool:
        return _format.TREE_KEY in self.metadata

    @property
    def description(self) -> Any:
        if self._description is None:
            text = self.metadata.get(_format.TREE_KEY, "null")
            self._description = _format.parse_description(text, self._shapes, self.bad)
        return self._description

    def arrays(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return self._shapes

    def read_many(
        self, names: list[str], *, verify: bool = True, parallel: bool = True
    ) -> dict[str, np.ndarray]:
        return {name: self.read(name, verify=verify) for name in names}

    def read(
        self, name: str, index: tuple[slice, ...] | None = None, *, verify: bool = True
    ) -> np.ndarray:
        """The block `index` (default: all) of array `name`. With `verify`, each piece it
        touches is read whole once and checked (kept while blocks of the same array are
        read); without, only the rows of each piece that overlap the block are read."""
        shape, dtype = self._shapes[name]
        bounds = (
            [(0, d) for d in shape]
            if index is None
            else [
                s.indices(d)[:2]
                for s, d in zip(_format.normalize_index(index, shape), shape, strict=True)
            ]
        )
        if self._cached_for != name:
            self._cache.clear()
            self._cached_for = name
        jobs = []
        for piece in self._arrays[name]["pieces"]:
            overlap = [
                (max(a, pa), min(b, pb))
                for (a, b), (pa, pb) in zip(bounds, piece["index"], strict=True)
            ]
            if any(lo >= hi for lo, hi in overlap):
                continue
            jobs.append((piece, overlap))
        out = _format.aligned_empty([b - a for a, b in bounds], dtype)
        if not shape:
            jobs = [(self._arrays[name]["pieces"][0], [])]
        for piece, overlap in jobs:
            src = tuple(
                slice(lo - pa, hi - pa)
                for (lo, hi), (pa, _) in zip(overlap, piece["index"], strict=True)
            )
            dst = tuple(
                slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(overlap, bounds, strict=True)
            )
            reader = self._piece(name, piece)
            if verify:
                key = (piece["file"], piece["tensor"])
                if key not in self._cache:
                    self._cache[key] = reader.read(piece["tensor"], verify=True)
                out[dst] = self._cache[key][src]
            else:
                out[dst] = reader.read(piece["tensor"], src, verify=False)
        return out
