"""The `.shards` layout of a multi-process checkpoint: its index, validated whole before
anything is trusted, the reader that assembles any block of an array from the pieces, and
which piece files an index cites, and removing those that may go (for retention,
cleanup and an overwrite).

Layout (see docs/checkpoint_format.md; the names are `_names`'):

    {prefix}{step}.shards/
        index.safetensors                      the commit: no tensors; metadata holds the
                                               tree, step, and every array's pieces
        process_00000.{token}.safetensors      the pieces process 0 owns (plain safetensors)
        process_00001.{token}.safetensors      ...

The directory (on an object store: the key prefix) counts as a checkpoint only once its
index exists. `_multiprocess` writes it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..._text import short
from ..storage._base import Storage
from ._arrays import MAX_NDIM, aligned_empty, normalize_index
from ._description import OpenFile, ReaderBase
from ._json import parse_json
from ._leaf_kinds import CODE_TO_DTYPE
from ._names import ARRAYS_KEY, INDEX_NAME, PIECES_KEY, PROCESS_KEY, SAVE_KEY, parse_piece_file
from ._runs import split_axis as split_axis, split_bounds as split_bounds

_MAX_PIECES = 1 << 20


def referenced_pieces(store: Storage, path: str, open_file: OpenFile) -> set[str] | None:
    """The piece files a committed `.shards` directory's index cites (read with
    `open_file`); None if it has no index; every name in the directory if the index cannot
    be read (then nothing goes)."""
    index = store.join(path, INDEX_NAME)
    try:
        with open_file(index, store.open(index)) as reader:
            arrays = json.loads(reader.metadata[ARRAYS_KEY])
        return {piece["file"] for entry in arrays.values() for piece in entry["pieces"]}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {item.name for item in store.list(path)}


def remove_paths(store: Storage, paths: list[str]) -> None:
    for path in paths:
        store.remove(path)


def remove_if_uncommitted_and_empty(store: Storage, path: str) -> None:
    if not store.exists(store.join(path, INDEX_NAME)):
        store.remove_dir_if_empty(path)


def remove_replaced_pieces(store: Storage, path: str, replaced: set[str], keep: set[str]) -> None:
    """After process 0 commits an overwrite: the pieces the replaced index cited go, and no
    others (a concurrent save's pieces belong to it)."""
    remove_paths(store, [store.join(path, name) for name in sorted(replaced - keep)])


def validate_arrays(raw: Any, bad: Callable[[str], Exception]) -> dict[str, dict[str, Any]]:
    """Checks a whole index before anything is opened or allocated: names, dtypes, shapes,
    piece files (plain names of this library's form, never a path), and that each array's
    pieces lie inside it and tile it exactly once."""
    if not isinstance(raw, dict):
        raise bad("its array table is not a JSON object")
    total_pieces = 0
    for name, entry in raw.items():
        where = f"array {short(name)}"
        if not isinstance(entry, dict) or set(entry) != {"shape", "dtype", "pieces"}:
            raise bad(f"{where} has a malformed entry")
        shape, code, pieces = entry["shape"], entry["dtype"], entry["pieces"]
        if not isinstance(code, str) or code not in CODE_TO_DTYPE:
            raise bad(f"{where} has unsupported dtype {short(code)}")
        if not (
            isinstance(shape, list)
            and len(shape) <= MAX_NDIM
            and all(type(s) is int and s >= 0 for s in shape)
        ):
            raise bad(f"{where} has an invalid shape {short(shape)}")
        if not isinstance(pieces, list) or not pieces:
            raise bad(f"{where} has no pieces")
        total_pieces += len(pieces)
        if total_pieces > _MAX_PIECES:
            raise bad(f"the index lists more than {_MAX_PIECES} pieces")
        boxes = []
        for piece in pieces:
            if not isinstance(piece, dict) or set(piece) != {"file", "tensor", "index"}:
                raise bad(f"{where} has a malformed piece {short(piece)}")
            file, tensor, ranges = piece["file"], piece["tensor"], piece["index"]
            if not isinstance(file, str) or parse_piece_file(file) is None:
                raise bad(f"{where} cites the file {short(file)}, not a piece file name")
            if not isinstance(tensor, str):
                raise bad(f"{where} has a piece with tensor name {short(tensor)}")
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
                raise bad(f"{where} has a piece with invalid bounds {short(ranges)}")
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


class ShardedReader(ReaderBase):
    """A `.shards` checkpoint as one reader: its index (validated whole first), then any
    block of any array, read only from the pieces that overlap it."""

    # A target's device blocks are read block by block, never whole: each block reads only
    # the pieces it overlaps (the restore asks a reader for this, not for its class).
    reads_blocks = True

    def __init__(self, store: Storage, directory: str, open_file: OpenFile):
        self.path = directory
        self.store = store
        self._open = open_file
        index = store.join(directory, INDEX_NAME)
        self.index = open_file(index, store.open(index))
        self._files: dict[str, Any] = {}
        self._records: dict[str, dict[str, Any]] = {}
        self._checked: set[tuple[str, str]] = set()
        try:
            raw = self.index.metadata.get(ARRAYS_KEY)
            if raw is None:
                raise self.bad("its index has no array table")
            self._arrays = validate_arrays(parse_json(raw, "the array table", self.bad), self.bad)
            self.metadata = self.index.metadata
            # The save every piece must belong to; None in an index written before saves
            # were bound to their pieces (those pieces are trusted by name, as then).
            self._save = self.metadata.get(SAVE_KEY)
            if self._save is None:
                self._check_one_save()
            # Locally, open (and so pin) every piece file now: an overwrite that commits
            # meanwhile cannot pull them away, and each header is checked against the index.
            # On an object store each open is a request: pieces are opened (and checked)
            # when first read, so a host fetches only the pieces its devices need.
            for name, entry in self._arrays.items() if store.cheap_reads else ():
                for piece in entry["pieces"]:
                    self._piece(name, piece)
        except BaseException:
            self.close()
            raise
        # Built once: every block read looks its array up here.
        self._shapes = {
            name: (tuple(e["shape"]), CODE_TO_DTYPE[e["dtype"]]) for name, e in self._arrays.items()
        }
        self._cache: dict[tuple[str, str], np.ndarray] = {}
        self._cached_for: str | None = None

    def _piece(self, name: str, piece: dict[str, Any]) -> Any:
        """The open piece file of `piece` (of array `name`), checked once against the index:
        the piece file's own record of the piece must match."""
        reader = self._file(piece["file"])
        key = (piece["file"], piece["tensor"])
        if key not in self._checked:
            dtype = CODE_TO_DTYPE[self._arrays[name]["dtype"]]
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
                    f"array {short(name)}: piece {short(piece['tensor'])} is "
                    f"not in {piece['file']} as {dtype}{list(extents)}"
                )
            self._checked.add(key)
        return reader

    def _index_replaced(self) -> bool:
        now = self.store.identity(self.store.join(self.path, INDEX_NAME))
        return now != self.index.source.identity

    def _file(self, name: str) -> Any:
        if name not in self._files:
            path = self.store.join(self.path, name)
            try:
                reader = self._open(path, self.store.open(path))
            except FileNotFoundError:
                if self._index_replaced():
                    raise  # an overwrite or retention came after we opened the index: retry
                raise self.bad(f"the piece file {name} it cites is missing") from None
            try:
                self._check_bound(name, reader)
            except BaseException:
                reader.close()
                raise
            self._files[name] = reader
        return self._files[name]

    def _check_bound(self, name: str, reader: Any) -> None:
        """Refuses a piece file that another save (or another process of this save) wrote,
        copied under the name the index cites: before any of its bytes are used."""
        if self._save is None:
            # A piece that names its save was written by a save whose index names it too:
            # under an index without one, it was copied there from another save.
            if SAVE_KEY in reader.metadata:
                raise self.bad(
                    f"the piece file {name} is of save {short(reader.metadata[SAVE_KEY])}, but "
                    "the index, written before pieces were bound to their save, names no save "
                    "(a piece of a newer save copied under this name)"
                )
            return
        process, token = parse_piece_file(name) or (None, None)  # the index checked it
        own = (reader.metadata.get(SAVE_KEY), reader.metadata.get(PROCESS_KEY))
        if token != self._save or own != (self._save, str(process)):
            raise self.bad(
                f"the piece file {name} is not the piece it cites: the index is of save "
                f"{self._save} and cites it as process {process}'s piece, but the file says "
                f"save {short(own[0])}, process {short(own[1])} (a piece of another save, "
                "step or run, or of another process, copied under this name)"
            )

    def _check_one_save(self) -> None:
        """An index without a save id (written before pieces were bound to their save) is
        trusted by its piece names, which every writer gave one save's token: names of two
        tokens are an index edited to cite another save's piece."""
        cited = {p["file"] for e in self._arrays.values() for p in e["pieces"]}
        tokens = {(parse_piece_file(file) or (0, None))[1] for file in cited}
        if len(tokens) > 1:
            raise self.bad(
                f"its index cites pieces of more than one save ({len(tokens)} save tokens "
                "among its piece file names)"
            )

    def check_unchanged(self) -> None:
        """Raises `ObjectReplacedError` if the index or a piece read was replaced since it
        was opened (see `FileReader.check_unchanged`)."""
        for reader in [self.index, *self._files.values()]:
            reader.check_unchanged()

    def close(self) -> None:
        self.index.close()
        for reader in self._files.values():
            reader.close()

    def _own_records(self, file: str) -> dict[str, Any]:
        """What a piece file says of its own pieces (leaf and slice), to cross-check the index."""
        if file not in self._records:
            raw = self._file(file).metadata.get(PIECES_KEY, "{}")
            records = parse_json(raw, f"the piece table of {file}", self.bad)
            self._records[file] = records if isinstance(records, dict) else {}
        return self._records[file]

    def arrays(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return self._shapes

    def files(self) -> dict[str, Any]:
        """Every piece file the index cites, opened (and pinned), by path."""
        names = sorted({p["file"] for e in self._arrays.values() for p in e["pieces"]})
        return {self.store.join(self.path, name): self._file(name) for name in names}

    def read_many(
        self, names: Sequence[str], *, verify: bool = True, parallel: bool = True
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
                s.indices(d)[:2] for s, d in zip(normalize_index(index, shape), shape, strict=True)
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
        out = aligned_empty([b - a for a, b in bounds], dtype)
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
