"""Multi-process checkpoints on `jax.distributed`: which pieces each process writes, the
commit protocol, and the reader that assembles any block of an array from the pieces.

Layout of a `.shards` checkpoint (see docs/checkpoint_format.md):

    {prefix}{step}.shards/
        index.safetensors                      the commit: no tensors; metadata holds the
                                               tree, step, and every array's pieces
        process_00000.{token}.safetensors      the pieces process 0 owns (plain safetensors)
        process_00001.{token}.safetensors      ...

The directory counts as a checkpoint only once its index exists. The index is written last,
by process 0, through a temporary file renamed over the old index: an overwrite switches
from the old pieces to the new ones in one atomic step, so a crash leaves the old checkpoint
or the new one, never neither.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from . import _files, _format, _names

PIECES_KEY = "eqx_train.pieces"
_POLL_S = 0.02
_MAX_PIECES = 1 << 20


class BarrierTimeoutError(TimeoutError):
    """A multi-process checkpoint step waited longer than `timeout_s` for its peers."""


def broadcast_token(timeout_s: int | float, caller: str) -> str:
    """A save token chosen by process 0 (it names process 0 as the writer), the same on
    every process."""
    if jax.process_count() == 1:
        return _names.new_token()
    from jax.experimental import multihost_utils

    host, pid = _names.host_id(), os.getpid()
    random = os.urandom(8)
    mine = np.array(
        [int(host, 16), pid, int.from_bytes(random[:4]), int.from_bytes(random[4:])],
        dtype=np.uint32,
    )
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["token"] = np.asarray(multihost_utils.broadcast_one_to_all(mine))
        except BaseException as error:  # re-raised in the caller's thread
            result["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise BarrierTimeoutError(
            f"{caller}: process {jax.process_index()} waited {timeout_s}s for the other "
            "processes to start the save; every process must call it with the same step."
        )
    if "error" in result:
        raise result["error"]
    h, p, r0, r1 = (int(v) for v in result["token"])
    return f"{h:08x}-{p}-{r0:08x}{r1:08x}"


def _wait_until(
    pending: Callable[[], list[str]], timeout_s: int | float, what: str, caller: str
) -> None:
    """Polls until `pending()` (what is still missing) is empty, or raises
    BarrierTimeoutError naming it."""
    deadline = time.monotonic() + timeout_s
    while remaining := pending():
        if time.monotonic() > deadline:
            raise BarrierTimeoutError(
                f"{caller}: waited {timeout_s}s for {what}; still waiting on: {remaining}. "
                "A peer process probably died or never called save; the previous "
                "checkpoint is still the latest."
            )
        time.sleep(_POLL_S)


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
            owned = [
                (
                    [
                        list(s.indices(d)[:2])
                        for s, d in zip(shard.index, tensor.shape, strict=True)
                    ],
                    lambda data=shard.data: np.asarray(data),
                )
                for shard in source.addressable_shards
                if shard.replica_id == 0
            ]
        else:
            owned = [([[0, d] for d in tensor.shape], tensor.get)] if process == 0 else []
        for k, (ranges, get) in enumerate(owned):
            name = f"{tensor.name}#{process}.{k}"
            shape = tuple(b - a for a, b in ranges)
            pieces.append(_format.Tensor(name, get, tensor.dtype, shape))
            where[name] = {"leaf": tensor.name, "index": ranges}
    return pieces, where


def write_and_commit(
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
    """Every process writes its piece file and a done marker; process 0 waits for all
    markers, writes the index (the commit), drops the replaced pieces, runs `after_commit`
    (retention), then removes the markers, which releases the others."""
    process, count = jax.process_index(), jax.process_count()
    os.makedirs(final_dir, exist_ok=True)
    markers = [os.path.join(final_dir, _names.done_marker(i, token)) for i in range(count)]
    committed = False
    try:
        _files.atomic_write(
            os.path.join(final_dir, _names.piece_file(process, token)),
            lambda fd: _format.write_file(fd, pieces, {PIECES_KEY: json.dumps(where)}),
        )
        _files.atomic_write(markers[process], lambda fd: None)
        if process != 0:
            _wait_until(
                lambda: ["process 0"] if os.path.exists(markers[process]) else [],
                timeout_s,
                "process 0 to commit",
                caller,
            )
            # Process 0 removes the markers on success and on failure: the index says which.
            if _names.piece_file(process, token) not in (_files.referenced_pieces(final_dir) or ()):
                raise RuntimeError(
                    f"{caller}: process 0 did not commit this save (its own error says why); "
                    "the previous checkpoint is still the latest."
                )
            return
        _wait_until(
            lambda: [f"process {i}" for i, m in enumerate(markers) if not os.path.exists(m)],
            timeout_s,
            "every process to write its pieces",
            caller,
        )
        arrays = _collect_index(final_dir, token, count, tensors, caller)
        replaced = _files.referenced_pieces(final_dir) or set()
        index_metadata = {
            **metadata,
            _format.ARRAYS_KEY: json.dumps(arrays, separators=(",", ":")),
        }
        _files.atomic_write(
            os.path.join(final_dir, _names.INDEX_NAME),
            lambda fd: _format.write_file(fd, [], index_metadata),
            replace=overwrite,
        )
        committed = True
        _files.remove_replaced_pieces(
            final_dir, replaced, {_names.piece_file(i, token) for i in range(count)}
        )
        after_commit()
        for marker in markers:
            os.remove(marker)
    except BaseException:
        if not committed:
            # This save will never commit: take back what it wrote (process 0: every
            # process's pieces of this token), so no uncommitted litter stays behind.
            mine = {markers[process], os.path.join(final_dir, _names.piece_file(process, token))}
            if process == 0:
                mine |= set(markers)
                mine |= {os.path.join(final_dir, _names.piece_file(i, token)) for i in range(count)}
            _files.remove_paths(sorted(mine))
            _files.remove_if_uncommitted_and_empty(final_dir)
        raise


def _collect_index(
    final_dir: str, token: str, count: int, tensors: list[_format.Tensor], caller: str
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
        with _format.FileReader(os.path.join(final_dir, file_name)) as reader:
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


def is_sharded_checkpoint(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, _names.INDEX_NAME))


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

    def __init__(self, directory: str):
        self.path = directory
        self.index = _format.FileReader(os.path.join(directory, _names.INDEX_NAME))
        self._files: dict[str, _format.FileReader] = {}
        self._records: dict[str, dict[str, Any]] = {}
        try:
            raw = self.index.metadata.get(_format.ARRAYS_KEY)
            if raw is None:
                raise self.bad("its index has no array table")
            self._arrays = _validate_arrays(
                _format.parse_json(raw, "the array table", self.bad), self.bad
            )
            self.metadata = self.index.metadata
            # Open (and so pin) every piece file now: an overwrite that commits meanwhile
            # cannot pull them away, and each header is checked against the index.
            for name, entry in self._arrays.items():
                dtype = _format.CODE_TO_DTYPE[entry["dtype"]]
                for piece in entry["pieces"]:
                    reader = self._file(piece["file"])
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
                            f"array {_format.short(name)}: piece "
                            f"{_format.short(piece['tensor'])} is not in {piece['file']} "
                            f"as {dtype}{list(extents)}"
                        )
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

    def _index_replaced(self) -> bool:
        try:
            now = os.stat(os.path.join(self.path, _names.INDEX_NAME))
        except FileNotFoundError:
            return True
        mine = os.fstat(self.index.fd)
        return (now.st_ino, now.st_dev) != (mine.st_ino, mine.st_dev)

    def _file(self, name: str) -> _format.FileReader:
        if name not in self._files:
            try:
                self._files[name] = _format.FileReader(os.path.join(self.path, name))
            except FileNotFoundError:
                if self._index_replaced():
                    raise  # an overwrite or retention came after we opened the index: retry
                raise self.bad(f"the piece file {name} it cites is missing") from None
        return self._files[name]

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
            infos = {
                name: _format.TensorInfo(name, dtype, shape, 0, 0)
                for name, (shape, dtype) in self._shapes.items()
            }
            description = _format.parse_json(
                self.metadata.get(_format.TREE_KEY, "null"), "the tree description", self.bad
            )
            _format.validate_description(description, infos, self.bad)
            self._description = description
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
            reader = self._file(piece["file"])
            if verify:
                key = (piece["file"], piece["tensor"])
                if key not in self._cache:
                    self._cache[key] = reader.read(piece["tensor"], verify=True)
                out[dst] = self._cache[key][src]
            else:
                out[dst] = reader.read(piece["tensor"], src, verify=False)
        return out
