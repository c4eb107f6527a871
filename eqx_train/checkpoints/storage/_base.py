"""Every seam of the storage layer in one file: what a listing returns (`Item`), an open
file (`Source`), the interface the checkpoint code sees (`Storage`, with its capabilities),
and `StorageBase`, which builds that whole interface from five primitives, so that a new
backend writes those five and one registration line (`register_storage`).

The promise is the same for every backend: `atomic_write` makes a file appear whole or not
at all, listings show only what is there now, and `open` gives a byte source that stays one
version of the file (or says, in `check_unchanged`, that it did not).

**Capabilities.** What differs between backends in a way the layers above must know is
said by five named facts, never by which backend it is:

- `atomic_rename`: `move` renames a file or a whole directory in one step, and the file
  keeps its identity. False: a move copies each object, then removes it (a `.shards`
  directory is moved object by object, its index last).
- `cheap_reads`: asking about a file (its size, whether it exists), opening it and reading
  a few bytes costs no round trip, so readers ask exactly what they need, read in small
  sequential chunks (hashing each while in cache) and pin every piece of a checkpoint by
  opening it. False: every request is a round trip, so readers batch: one listing of every
  key under a prefix, one larger first request for a header, ranged reads all at once.
- `os_errors_mean_bad_media`: an `OSError` whose errno says a file cannot be read (`EIO`,
  `EBADMSG`, `EUCLEAN`) means the stored file is damaged: a manager's restore falls back
  past it, and retention may count it as unreadable. False: such an error comes from the
  network or a service and says nothing about the checkpoint.
- `stale_by_age`: what a writer on another machine left (an uncommitted piece, an upload
  marker) is judged abandoned once it is older than the cleanup threshold, since no machine
  owns the store. False: only a writer on this machine is judged, by whether its process
  lives.
- `save_deadline`: all the requests of one save share a time budget from `start_deadline`,
  so a save is never queued behind another (its budget would run out while it waits).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from .._errors import ObjectReplacedError as ObjectReplacedError, invalid
from ._items import Item as Item, Upload as Upload


@runtime_checkable
class Source(Protocol):
    """An open file: its size, reads of byte ranges, and an identity (two opens of the same
    version of a file have equal identities). `cheap_reads` as on its `Storage`."""

    path: str
    size: int
    identity: Any
    cheap_reads: bool

    def read_into(self, view: memoryview, offset: int) -> None: ...

    def read_ranges(self, jobs: Sequence[tuple[memoryview, int]]) -> None: ...

    def check_unchanged(self) -> None: ...

    def close(self) -> None: ...


Writer = Callable[[Any], None]  # receives an int fd (local) or a binary stream (the others)


@runtime_checkable
class Storage(Protocol):
    """The operations the checkpoint code needs from where checkpoints live, and the
    capabilities (described in `eqx_train.checkpoints.storage`) that tell the layers above
    how to use them. `StorageBase` implements all of it from five primitives."""

    atomic_rename: bool
    cheap_reads: bool
    os_errors_mean_bad_media: bool
    stale_by_age: bool
    save_deadline: bool

    def join(self, directory: str, name: str) -> str:
        """The path of `name` inside `directory`."""
        ...

    def list(self, directory: str) -> list[Item]:
        """What is directly in `directory` (empty if nothing, or no such directory)."""
        ...

    def find(self, directory: str, prefix: str) -> list[Item]:
        """Every file under `directory` whose relative name starts with `prefix`, named
        relative to `directory` (`a.shards/index.safetensors`)."""
        ...

    def is_file(self, path: str) -> bool:
        """Whether `path` is a regular file (or an object)."""
        ...

    def is_dir(self, path: str) -> bool:
        """Whether `path` is a directory (or a prefix with objects under it)."""
        ...

    def exists(self, path: str) -> bool:
        """Whether anything is at `path` (a dangling link included)."""
        ...

    def makedirs(self, path: str) -> None:
        """Creates the directory `path` and its parents, durably, where directories exist."""
        ...

    def start_deadline(self) -> None:
        """Starts the time budget that the requests of one save share (`save_deadline`)."""
        ...

    def atomic_write(self, path: str, write: Writer, *, replace: bool = True) -> None:
        """Makes what `write` writes (to an int fd, or to a binary stream) the file
        `path`, whole or not at all; `replace=False` refuses an existing file
        (`FileExistsError`) and never clobbers one."""
        ...

    def open(self, path: str) -> Source:
        """The file `path`, to read (`FileNotFoundError` if absent)."""
        ...

    def identity(self, path: str) -> Any:
        """What tells this version of `path` from another saved under its name; None if
        nothing is there. Equal to `open(path).identity` for the same version."""
        ...

    def version(self, path: str) -> Any:
        """Like `identity`, but never equal for two files that lived under one name (a
        local inode number alone may be reused); compared across a `move`."""
        ...

    def remove(self, path: str) -> None:
        """Removes the file `path`, best effort: never raises."""
        ...

    def move(self, path: str, new_path: str) -> None:
        """Moves `path` to `new_path`, which must not exist (`FileExistsError`)."""
        ...

    def remove_dir_if_empty(self, path: str) -> None:
        """Removes the directory `path` if it is empty, best effort."""
        ...

    def unfinished_uploads(self, directory: str) -> list[Upload]:
        """Uploads begun under `directory` and never completed (S3 multipart)."""
        ...

    def abort_upload(self, directory: str, upload: Upload) -> None:
        """Aborts `upload`, one of `unfinished_uploads(directory)`."""
        ...


class StorageBase:
    """A `Storage` built from five primitives that a subclass writes: `info`, `list`,
    `read`, `put` and `delete`. Paths are URLs `scheme://...` (as `register_storage` hands
    them over), with `/` between names; directories are implicit (a prefix exists once a
    file is under it).

    The capabilities default to what holds for any store reached over a network (no
    rename, every request a round trip, errors of the transport, writers judged by age);
    a subclass that knows better sets them as class attributes. Every other method has a
    default over the primitives, and may be overridden where the backend has a faster way.

    `put` must make the file appear whole or not at all (a whole-object write does); the
    default `atomic_write` gathers what the writer writes in memory and puts it in one
    call, after checking, for `replace=False`, that the name is free (a check then a write:
    a backend with a conditional create overrides `atomic_write`).
    """

    atomic_rename: bool = False
    cheap_reads: bool = False
    os_errors_mean_bad_media: bool = False
    stale_by_age: bool = True
    save_deadline: bool = False

    # -------------------------------------------------------------- the five primitives

    def info(self, path: str) -> Item | None:
        """What `path` is: an `Item` with `is_file` and `size` (and, where known,
        `identity` and `modified`) for a file, with `is_dir` for a directory, or None when
        nothing is there."""
        raise NotImplementedError

    def list(self, directory: str) -> list[Item]:
        """The files and subdirectories directly in `directory` (empty when there are
        none, or no such directory)."""
        raise NotImplementedError

    def read(self, path: str, offset: int, size: int) -> bytes:
        """The `size` bytes of the file `path` from `offset` (fewer only at its end)."""
        raise NotImplementedError

    def put(self, path: str, data: bytes) -> None:
        """Stores `data` as the file `path`, replacing any; it appears whole or not at
        all."""
        raise NotImplementedError

    def delete(self, path: str) -> None:
        """Removes the file `path` (`FileNotFoundError` if there is none)."""
        raise NotImplementedError

    # ------------------------------------------------------- derived, with defaults

    def join(self, directory: str, name: str) -> str:
        if directory.endswith("://"):  # the root of a store
            return directory + name
        return directory.rstrip("/") + "/" + name

    def find(self, directory: str, prefix: str) -> list[Item]:
        """Every file whose path relative to `directory` starts with `prefix`, at any
        depth, named relative to `directory`."""
        found: list[Item] = []
        pending = [("", item) for item in self.list(directory) if item.name.startswith(prefix)]
        while pending:
            parent, item = pending.pop()
            name = f"{parent}{item.name}"
            if item.is_file:
                found.append(
                    Item(name, item.path, False, True, item.modified, item.identity, item.size)
                )
            elif item.is_dir:
                pending += [(f"{name}/", sub) for sub in self.list(item.path)]
        return sorted(found, key=lambda item: item.name)

    def is_file(self, path: str) -> bool:
        item = self.info(path)
        return item is not None and item.is_file

    def is_dir(self, path: str) -> bool:
        item = self.info(path)
        return item is not None and item.is_dir

    def exists(self, path: str) -> bool:
        return self.info(path) is not None

    def makedirs(self, path: str) -> None:
        """Nothing to do: a directory exists once a file is in it."""

    def start_deadline(self) -> None:
        """No budget shared by the requests of one save (`save_deadline` is False)."""

    def atomic_write(self, path: str, write: Writer, *, replace: bool = True) -> None:
        """Puts what `write(stream)` writes as the file `path`, whole. With
        `replace=False` an existing file is refused (`FileExistsError`)."""
        buffer = BytesSink()
        write(buffer)
        if not replace and self.exists(path):
            raise FileExistsError(path)
        self.put(path, bytes(buffer.data))

    def open(self, path: str) -> Source:
        return RangeSource(self, path)

    def identity(self, path: str) -> Any:
        """What tells this version of `path` from another saved under its name (None if
        nothing is there): the `identity` `info` reports, else its size and time."""
        item = self.info(path)
        if item is None:
            return None
        return item.identity if item.identity is not None else (item.size, item.modified)

    def version(self, path: str) -> Any:
        """Like `identity`, for a caller that compares versions across a `move`."""
        return self.identity(path)

    def remove(self, path: str) -> None:
        # Best effort: a name that cannot be removed is left, and never stops a save.
        with contextlib.suppress(OSError):
            self.delete(path)

    def move(self, path: str, new_path: str) -> None:
        """Copies the file `path` to `new_path` (which must not exist: `FileExistsError`),
        then removes it."""
        if self.exists(new_path):
            raise FileExistsError(f"{new_path} already exists")
        item = self.info(path)
        if item is None or not item.is_file:
            raise FileNotFoundError(path)
        self.put(new_path, self.read(path, 0, item.size or 0))
        self.remove(path)

    def remove_dir_if_empty(self, path: str) -> None:
        """Nothing to do: a directory goes with its last file."""

    def unfinished_uploads(self, directory: str) -> list[Upload]:
        return []

    def abort_upload(self, directory: str, upload: Upload) -> None:
        """No uploads to abort."""


class BytesSink:
    """A binary stream that keeps what is written to it in memory."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, chunk: Any) -> int:
        self.data += chunk
        return memoryview(chunk).nbytes


class RangeSource:
    """A file of a `StorageBase`, read by `read` requests. The store may not pin a
    version, so a reader calls `check_unchanged` after its last read: if the file was
    replaced meanwhile, it raises `ObjectReplacedError` and the restore starts again."""

    def __init__(self, store: StorageBase, path: str):
        self.path = path
        self.cheap_reads = store.cheap_reads
        self._store = store
        self._bad = invalid(path)
        item = store.info(path)
        if item is None:
            raise FileNotFoundError(path)
        if not item.is_file:
            raise self._bad("it is a directory, not a file")
        self.size = int(item.size or 0)
        self.identity = store.identity(path)

    def read_into(self, view: memoryview, offset: int) -> None:
        if offset + len(view) > self.size:
            raise self._bad("it ended early (truncated)")
        data = self._store.read(self.path, offset, len(view))
        if len(data) != len(view):
            raise self._bad("it ended early (truncated)")
        view[:] = data

    def read_ranges(self, jobs: Sequence[tuple[memoryview, int]]) -> None:
        for view, offset in jobs:
            self.read_into(view, offset)

    def check_unchanged(self) -> None:
        if self._store.identity(self.path) != self.identity:
            raise ObjectReplacedError(
                f"{self.path} was replaced or removed while it was being read"
            )

    def close(self) -> None:
        pass
