"""What a path holds, decided in one place for `restore_checkpoint`, `plan_restore`,
`CheckpointManager.restore`, `eqx_train.interop.load_sharded` and `eqx-train`: one of our
layouts (a checkpoint file, a `.shards` directory, a Hugging Face `model.safetensors` or
sharded index, given as the directory or the file), a directory of checkpoints, or weights
we do not read here (flax msgpack, Orbax, a PyTorch pickle), refused naming what they are
and the call that reads them.

Foreign layouts are sniffed only where our own reading found nothing (an empty listing) or
failed (a header that is not safetensors): recognising our own checkpoints costs nothing
more than before. Every question goes through the location's `Storage`, so each layout
reads from any store; where a question costs a round trip (`cheap_reads` is False) fewer
are asked, and Orbax directories are recognised only where they are cheap.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

import numpy as np

from ..._text import short
from .._errors import (
    TORCH_HOW as _TORCH_HOW,
    CheckpointFormatError,
    Foreign as Foreign,
    ForeignCheckpointError as ForeignCheckpointError,
)
from ..storage._base import Storage
from ..storage._local import LocalStorage
from ..storage._urls import is_url
from . import _names
from ._hf_layout import IndexReader
from ._reader import FileReader
from ._shards import ShardedReader

Layout = Literal["file", "shards", "hf", "directory"]


@runtime_checkable
class Reader(Protocol):
    """One checkpoint, whatever its layout, as the matcher and the command line see it:
    implemented by `FileReader` (one file), `ShardedReader` (a `.shards` directory) and
    `IndexReader` (a Hugging Face directory), and the interop layer's readers of
    flax and Orbax checkpoints. Use as a context manager."""

    path: str
    metadata: dict[str, str]  # the file's (or index's) `__metadata__`

    @property
    def has_description(self) -> bool:
        """False for a checkpoint written by another tool (no tree description)."""
        ...

    def description(self) -> Any:
        """The tree description, validated against `arrays()` (parsed on the first call)."""
        ...

    def bad(self, why: str) -> CheckpointFormatError:
        """The error saying this checkpoint is not valid, and why."""
        ...

    def arrays(self) -> Mapping[str, tuple[tuple[int, ...], np.dtype]]:
        """Every tensor: name -> (shape, dtype)."""
        ...

    def read(
        self, name: str, index: tuple[slice, ...] | None = None, *, verify: bool = True
    ) -> np.ndarray:
        """Tensor `name`, or its block `index`."""
        ...

    def read_many(
        self, names: Sequence[str], *, verify: bool = True, parallel: bool = True
    ) -> dict[str, np.ndarray]:
        """Whole tensors, by name."""
        ...

    def files(self) -> dict[str, FileReader]:
        """Every file holding tensor data, opened, by path."""
        ...

    def check_unchanged(self) -> None:
        """Raises `ObjectReplacedError` if a file read was replaced since it was opened."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> None: ...


# How each readable layout is opened: `open_reader` picks the opener by the layout `locate`
# (or a directory listing) found. A new layout is one reader class and one entry here.
Opener = Callable[[Storage, str], Reader]

_SNIFF_BYTES = 16
_INDEX_SUFFIX = ".index.json"
_TORCH_SUFFIXES = (".bin", ".pt", ".pth")
_MSGPACK_SUFFIX = ".msgpack"
_ORBAX_MARKERS = ("_METADATA", "manifest.ocdbt", "checkpoint")


class Location(NamedTuple):
    """A path and what it holds (a directory listing's `Entry` says the same of a listed
    checkpoint). For `"hf"`, the path is the file to read: `model.safetensors` or the index."""

    path: str
    layout: Layout


_LOCAL = LocalStorage()


def hf_file(directory: str, store: Storage = _LOCAL) -> str | None:
    """The file of a Hugging Face directory (on the local disk unless `store` says
    otherwise): `model.safetensors` when present (as `transformers` prefers it), else its
    index; None when it holds neither."""
    single = store.join(directory, _names.HF_SINGLE_NAME)
    # A dangling link (a Hugging Face cache's blob not downloaded) is weights that cannot be
    # read, not an empty directory: it is named when opened.
    if store.is_file(single) or (store.exists(single) and not store.is_dir(single)):
        return single
    index = store.join(directory, _names.HF_INDEX_NAME)
    return index if store.exists(index) else None


def locate(store: Storage, path: str) -> Location | None:
    """What `path` holds: a checkpoint file, a committed `.shards` directory, a Hugging Face
    directory or index file (local), or else any other directory (of checkpoints, say); None
    if nothing is there. Each question is asked once (on an object store, one request)."""
    if store.is_dir(path):
        if store.is_file(store.join(path, _names.INDEX_NAME)):
            return Location(path, "shards")
        # Where a question costs a round trip, a directory of checkpoints is listed first,
        # and a Hugging Face file looked for only if it holds none (`foreign_directory`).
        found = hf_file(path, store) if store.cheap_reads else None
        return Location(found, "hf") if found else Location(path, "directory")
    if not store.exists(path):
        return None
    return Location(path, "hf" if path.endswith(_INDEX_SUFFIX) else "file")


def _open_file(store: Storage, path: str) -> Reader:
    try:
        return FileReader(path, store.open(path))
    except CheckpointFormatError:
        # A safetensors header can start with any byte: sniff only once it failed.
        foreign = sniff_file(store, path)
        if foreign is not None:
            raise foreign from None
        raise


def _open_hf(store: Storage, path: str) -> Reader:
    if path.endswith(".json"):
        directory, name = _split(path)
        return IndexReader(directory, store, FileReader, name)
    return _open_file(store, path)


def _open_shards(store: Storage, path: str) -> Reader:
    return ShardedReader(store, path, FileReader)


OPENERS: dict[str, Opener] = {
    "file": _open_file,
    "shards": _open_shards,
    "hf": _open_hf,
}


def open_reader(store: Storage, entry: Any) -> Reader:
    """The reader of the checkpoint `entry` (from a listing, or `locate`), by its layout
    (`OPENERS`); `ForeignCheckpointError` for a file that turns out to hold weights of
    another kind."""
    opener = OPENERS.get(entry.layout)
    if opener is None:
        raise ValueError(f"{entry.path} is not a checkpoint (it holds a {entry.layout} layout)")
    return opener(store, entry.path)


def _split(path: str) -> tuple[str, str]:
    """(the directory, the file name) of a path or URL."""
    if not is_url(path):
        directory, name = os.path.split(path)
        return directory or ".", name
    directory, _, name = path.rpartition("/")
    return directory + "/" if directory.endswith(":/") else directory, name


def sniff_file(store: Storage, path: str) -> ForeignCheckpointError | None:
    """What a file that is not safetensors holds, from its first bytes, if we know it."""
    try:
        source = store.open(path)
    except (OSError, CheckpointFormatError):
        return None
    try:
        size = source.size
        head = bytearray(min(_SNIFF_BYTES, size))
        source.read_into(memoryview(head), 0)
    finally:
        source.close()
    length = int.from_bytes(head[:8], "little")
    if len(head) > 8 and head[8:9] == b"{" and length <= size - 8:
        # A safetensors file whose header is wrong (its length field may start with any
        # byte, 0x80 included): its own error says what is wrong, not a pickle's.
        return None
    if head[:4] == b"PK\x03\x04":
        return ForeignCheckpointError(
            path,
            "torch",
            "a zip archive (what torch.save writes; NumPy's .npz is one too)",
            _TORCH_HOW + " (or numpy.load for an .npz)",
        )
    if len(head) > 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return ForeignCheckpointError(path, "torch", "a Python pickle (PyTorch's legacy format)")
    if head and (0x80 <= head[0] <= 0x8F or head[0] in (0xDE, 0xDF)):
        return ForeignCheckpointError(path, "flax", "a flax msgpack checkpoint")
    if head.lstrip()[:1] == b"{":
        return ForeignCheckpointError(
            path,
            "json",
            "a JSON file",
            f"a Hugging Face index of sharded weights is read when its name ends in "
            f"'{_INDEX_SUFFIX}' (as {_names.HF_INDEX_NAME}), or pass its directory",
        )
    return None


def is_orbax(path: str, store: Storage = _LOCAL) -> bool:
    """Whether a directory (on the local disk unless `store` says otherwise) is one Orbax
    PyTree checkpoint (the markers flax uses)."""
    return any(store.exists(store.join(path, m)) for m in _ORBAX_MARKERS)


def _subdirectories(store: Storage, path: str) -> list[str]:
    try:
        items = sorted(store.list(path), key=lambda item: item.name)
    except OSError:
        return []
    return [item.path for item in items if store.is_dir(item.path)]


def _orbax_within(store: Storage, path: str) -> bool:
    """An Orbax checkpoint, a `CheckpointManager` step of items, or a run of steps."""
    if is_orbax(path, store):
        return True
    return any(
        is_orbax(child, store)
        or any(is_orbax(item, store) for item in _subdirectories(store, child))
        for child in _subdirectories(store, path)
    )


def _kind(found: ForeignCheckpointError | None) -> str | None:
    return None if found is None else found.kind


def foreign_directory(store: Storage, path: str, prefix: str) -> Location | None:
    """For a directory with no checkpoint of ours in it: the Hugging Face file to read from
    it (on an object store), or `ForeignCheckpointError` naming the weights it holds and the
    call that reads them; None when it holds no weights (a new run's directory). Files are
    judged alike on a local disk and an object store (one listing, and the first bytes of
    each file that may be flax msgpack); Orbax directories are recognised where questions
    are cheap (`cheap_reads`: the local disk)."""
    if not store.cheap_reads:
        single = store.join(path, _names.HF_SINGLE_NAME)
        if store.exists(single):
            return Location(single, "hf")
        index = store.join(path, _names.HF_INDEX_NAME)
        if store.exists(index):
            return Location(index, "hf")
    elif _orbax_within(store, path):
        raise ForeignCheckpointError(path, "orbax", "a directory of Orbax checkpoints")
    files = sorted(
        item.name
        for item in store.list(path)
        if item.is_file and not item.name.startswith(".") and _names.parse_temp(item.name) is None
    )
    torch = [n for n in files if n.endswith(_TORCH_SUFFIXES)]
    if torch:
        raise ForeignCheckpointError(
            path, "torch", f"a directory of PyTorch pickles ({short(torch[:3])})"
        )
    flax = [
        n
        for n in files
        # Ours by name, or Hugging Face's flax_model.msgpack.
        if (n.startswith(prefix) or n.endswith(_MSGPACK_SUFFIX))
        and not n.endswith(".safetensors")
        and _kind(sniff_file(store, store.join(path, n))) == "flax"
    ]
    if flax:
        raise ForeignCheckpointError(
            path, "flax", f"a directory of flax msgpack checkpoints ({short(flax[:3])})"
        )
    other = [n for n in files if n.endswith(".safetensors")]
    if other:
        raise ForeignCheckpointError(
            path,
            "safetensors",
            f"a directory of safetensors files none of which is named "
            f"'{prefix}<step>.safetensors' ({short(other[:3])})",
            "pass the file to restore from, or the prefix it was saved with",
        )
    return None


# Readers of the layouts the interop layer reads (flax msgpack, Orbax), registered by
# `eqx_train.interop._readers` when it is imported: `plan_restore` plans them through the
# same matcher without the checkpoint package importing the layer above it.
FOREIGN_READERS: dict[str, Callable[[str, str], Any]] = {}
_FOREIGN_READERS_MODULE = "eqx_train.interop._readers"


def foreign_reader(kind: str, path: str, prefix: str) -> tuple[str, Any] | None:
    """(the call that reads `path`, its reader) for a flax or Orbax path; None otherwise."""
    if kind not in ("flax", "orbax"):
        return None
    if kind not in FOREIGN_READERS:
        importlib.import_module(_FOREIGN_READERS_MODULE)
    call = "load_flax_checkpoint" if kind == "flax" else "load_orbax_checkpoint"
    return call, FOREIGN_READERS[kind](path, prefix)
