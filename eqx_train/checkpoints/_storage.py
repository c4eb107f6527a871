"""Where checkpoints live: a local directory, or an object store behind an fsspec URL
(`s3://bucket/run`, `gs://bucket/run`, `memory://run`, `file:///abs/path`).

The rest of the checkpoint code sees one small interface (`Storage`) and never calls `os`
or a client library directly. Its promise is the same everywhere: `atomic_write` makes a
file appear whole or not at all, listings show only what is there now, and `open` gives a
byte source that stays one version of the file.

- Local paths (and `file://` URLs) keep the POSIX protocol: a temporary file, fsync, a
  rename (or a hard link, which never clobbers), fsync of the directory.
- Object stores have no rename. An object appears atomically when its upload completes, so
  a file is uploaded straight under its final name (multipart for large ones); an upload
  that fails is aborted, and one whose writer was killed stays invisible.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import stat
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from . import _names

# The fsspec protocols eqx_train knows, and the extra that installs each one's client.
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
_PART_BYTES = 64 << 20  # multipart upload part size
_READ_BYTES = 16 << 20  # bytes per ranged request; requests run in parallel
_MERGE_GAP = 64 << 10  # neighbouring ranges closer than this are fetched by one request
_MAX_REQUESTS = 16


@dataclass(frozen=True)
class Item:
    """One name in a listed directory."""

    name: str
    path: str
    is_dir: bool
    is_file: bool  # a regular file (or object), following symlinks
    modified: float | None = None  # seconds since the epoch, where the listing says


@runtime_checkable
class Source(Protocol):
    """An open file: its size, reads of byte ranges, and an identity (two opens of the same
    version of a file have equal identities)."""

    path: str
    size: int
    identity: Any
    is_local: bool  # local reads are cheap and sequential; object reads are batched

    def read_into(self, view: memoryview, offset: int) -> None: ...

    def read_ranges(self, jobs: Sequence[tuple[memoryview, int]]) -> None: ...

    def close(self) -> None: ...


Writer = Callable[[Any], None]  # receives an int fd (local) or a binary stream (objects)


@runtime_checkable
class Storage(Protocol):
    """The operations the checkpoint code needs from where checkpoints live."""

    is_local: bool

    def join(self, directory: str, name: str) -> str: ...

    def list(self, directory: str) -> list[Item]: ...

    def is_file(self, path: str) -> bool: ...

    def is_dir(self, path: str) -> bool: ...

    def exists(self, path: str) -> bool: ...

    def makedirs(self, path: str) -> None: ...

    def atomic_write(self, path: str, write: Writer, *, replace: bool = True) -> None: ...

    def open(self, path: str) -> Source: ...

    def identity(self, path: str) -> Any: ...

    def remove(self, path: str) -> None: ...

    def remove_dir_if_empty(self, path: str) -> None: ...

    def abort_uploads(self, directory: str, keep: Callable[[str], bool]) -> None: ...


# ------------------------------------------------------------------------------------- local


class _LocalSource:
    """A local file through one file descriptor: a rename over it meanwhile cannot mix two
    versions. Opened without blocking, and refused unless it is a regular file (a FIFO under
    a checkpoint name must not hang a restore)."""

    is_local = True

    def __init__(self, path: str, bad: Callable[[str], Exception]):
        self.path = path
        self._bad = bad
        try:
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except IsADirectoryError:
            raise bad("it is a directory, not a file") from None
        info = os.fstat(self.fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(self.fd)
            raise bad("it is not a regular file")
        self.size = info.st_size
        self.identity = (info.st_dev, info.st_ino)

    def read_into(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            count = os.preadv(self.fd, [view[done:]], offset + done)
            if count == 0:
                raise self._bad("it ended early (truncated)")
            done += count

    def read_ranges(self, jobs: Sequence[tuple[memoryview, int]]) -> None:
        for view, offset in jobs:
            self.read_into(view, offset)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage:
    """A POSIX directory tree."""

    is_local = True

    def join(self, directory: str, name: str) -> str:
        return os.path.join(directory, name)

    def list(self, directory: str) -> list[Item]:
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return []
        items = []
        for e in entries:
            try:
                items.append(Item(e.name, e.path, e.is_dir(follow_symlinks=False), e.is_file()))
            except OSError:
                continue
        return items

    def is_file(self, path: str) -> bool:
        try:
            return stat.S_ISREG(os.stat(path).st_mode)
        except OSError:
            return False

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def atomic_write(self, path: str, write: Writer, *, replace: bool = True) -> None:
        """Runs `write(fd)` on a temporary file, fsyncs it, moves it to `path`, fsyncs the
        directory. On any error the temporary file is removed and the previous files are
        untouched. With `replace=False` the move never clobbers: if `path` appeared meanwhile
        (a concurrent save of the same step), `FileExistsError` is raised and nothing is
        changed."""
        directory, name = os.path.split(path)
        temp_path = os.path.join(directory, _names.temp_name(name))
        fd = os.open(temp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                write(fd)
                os.fsync(fd)
            finally:
                os.close(fd)
            if replace or not _link(temp_path, path):
                os.replace(temp_path, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temp_path)
            raise
        fsync_dir(directory or ".")

    def open(self, path: str) -> Source:
        from ._format import CheckpointFormatError

        def bad(why: str) -> Exception:
            return CheckpointFormatError(f"{path} is not a valid checkpoint: {why}.")

        return _LocalSource(path, bad)

    def identity(self, path: str) -> Any:
        try:
            info = os.stat(path)
        except FileNotFoundError:
            return None
        return (info.st_dev, info.st_ino)

    def remove(self, path: str) -> None:
        # Best effort: a name we cannot remove (a directory, another user's file) is left,
        # and never stops a save.
        with contextlib.suppress(OSError):
            os.remove(path)

    def remove_dir_if_empty(self, path: str) -> None:
        with contextlib.suppress(OSError):
            os.rmdir(path)

    def abort_uploads(self, directory: str, keep: Callable[[str], bool]) -> None:
        """Local writes leave temporary files instead; `_files.remove_leftovers` handles them."""


def _link(temp_path: str, final_path: str) -> bool:
    """Moves `temp_path` to `final_path` unless it exists (then FileExistsError); False
    where the file system has no hard links, to fall back on a rename."""
    try:
        os.link(temp_path, final_path)
    except FileExistsError:
        raise
    except OSError:
        return False
    os.remove(temp_path)
    return True


# ----------------------------------------------------------------------------- object stores


class _ObjectSource:
    """An object: its size and ETag read once, then byte-range requests, several in
    parallel. A range read that finds another version of the object (an overwrite
    meanwhile) fails its checksum; the restore pipeline retries on the newer listing."""

    is_local = False

    def __init__(self, store: ObjectStorage, path: str, bad: Callable[[str], Exception]):
        self.path = path
        self._store = store
        self._bad = bad
        info = store.info(path)
        if info is None:
            raise FileNotFoundError(path)
        if info.get("type") != "file":
            raise bad("it is a directory, not a file")
        self.size = int(info["size"])
        self.identity = store.identity_of(info)

    def read_into(self, view: memoryview, offset: int) -> None:
        self.read_ranges([(view, offset)])

    def read_ranges(self, jobs: Sequence[tuple[memoryview, int]]) -> None:
        """Fills each view with the bytes at its offset. Large ranges are split and small
        neighbouring ones merged, so that every request moves about `_READ_BYTES`, and all
        requests run at once."""
        pieces = sorted(
            (offset + begin, view[begin : begin + _READ_BYTES])
            for view, offset in jobs
            for begin in range(0, len(view), _READ_BYTES)
        )
        for offset, view in pieces:
            if offset + len(view) > self.size:
                raise self._bad("it ended early (truncated)")
        spans: list[tuple[int, int, list[tuple[int, memoryview]]]] = []
        for offset, view in pieces:
            end = offset + len(view)
            if (
                spans
                and 0 <= offset - spans[-1][1] <= _MERGE_GAP
                and end - spans[-1][0] <= _READ_BYTES
            ):
                start, _, members = spans[-1]
                spans[-1] = (start, end, members)
                members.append((offset, view))
            else:
                spans.append((offset, end, [(offset, view)]))
        if not spans:
            return
        fs = self._store.fs
        path = self._store.strip(self.path)
        results = fs.cat_ranges(
            [path] * len(spans), [s for s, _, _ in spans], [e for _, e, _ in spans]
        )
        for (start, end, members), data in zip(spans, results, strict=True):
            if isinstance(data, BaseException):
                raise data
            if len(data) != end - start:
                raise self._bad("it ended early (truncated)")
            whole = memoryview(data)
            for offset, view in members:
                view[:] = whole[offset - start : offset - start + len(view)]

    def close(self) -> None:
        pass


class ObjectStorage:
    """A bucket (or fsspec memory store) addressed by URLs `protocol://bucket/key`."""

    is_local = False

    def __init__(self, protocol: str, fs: Any):
        self.protocol = protocol
        self.fs = fs
        self._lock = threading.Lock()

    def strip(self, path: str) -> str:
        return self.fs._strip_protocol(path)

    def join(self, directory: str, name: str) -> str:
        return directory.rstrip("/") + "/" + name

    def _url(self, stripped: str) -> str:
        return f"{self.protocol}://{stripped.lstrip('/')}"

    def _fresh(self, path: str) -> None:
        # fsspec caches listings; a checkpoint listing must see other writers' commits.
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(self.strip(path))

    def list(self, directory: str) -> list[Item]:
        self._fresh(directory)
        try:
            entries = self.fs.ls(self.strip(directory), detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        base = self.strip(directory).rstrip("/")
        items = []
        for e in entries:
            name = str(e["name"]).rstrip("/").rsplit("/", 1)[-1]
            if str(e["name"]).rstrip("/") == base:
                continue  # some stores list a "directory" marker object as itself
            kind = e.get("type")
            modified = _timestamp(e.get("LastModified") or e.get("mtime") or e.get("created"))
            items.append(
                Item(
                    name, self.join(directory, name), kind == "directory", kind == "file", modified
                )
            )
        return items

    def info(self, path: str) -> dict[str, Any] | None:
        self._fresh(path)
        try:
            return self.fs.info(self.strip(path))
        except FileNotFoundError:
            return None

    def is_file(self, path: str) -> bool:
        info = self.info(path)
        return info is not None and info.get("type") == "file"

    def is_dir(self, path: str) -> bool:
        info = self.info(path)
        return info is not None and info.get("type") == "directory"

    def exists(self, path: str) -> bool:
        return self.info(path) is not None

    def makedirs(self, path: str) -> None:
        """Object stores have no directories: a prefix exists once an object is under it."""

    def atomic_write(self, path: str, write: Writer, *, replace: bool = True) -> None:
        """Uploads what `write(stream)` writes as the object `path`: it appears only when
        the upload completes, and a failed upload is aborted. With `replace=False` an
        existing object is never clobbered (`FileExistsError`): through the store's
        conditional write where it has one, else by a check just before committing."""
        key = self.strip(path)
        if not replace and self.exists(path):
            raise FileExistsError(path)
        if _buffers_locally(self.fs):
            # The memory store commits a file the moment it is opened: build the bytes
            # first, then put them in one step.
            buffer = _Buffer()
            write(buffer)
            if not replace and self.exists(path):
                raise FileExistsError(path)
            self.fs.pipe_file(key, bytes(buffer.data))
            return
        stream = self.fs.open(key, "wb", block_size=_PART_BYTES)
        try:
            write(stream)
            if not replace and self.exists(path):
                raise FileExistsError(path)
        except BaseException:
            with contextlib.suppress(Exception):
                stream.discard()
            # A discarded file must never be closed: closing commits what was written (its
            # finaliser would try to).
            stream.closed = True
            raise
        stream.close()
        self._fresh(path)

    def open(self, path: str) -> Source:
        from ._format import CheckpointFormatError

        def bad(why: str) -> Exception:
            return CheckpointFormatError(f"{path} is not a valid checkpoint: {why}.")

        return _ObjectSource(self, path, bad)

    @staticmethod
    def identity_of(info: Mapping[str, Any]) -> Any:
        for key in ("ETag", "etag", "md5Hash", "generation", "VersionId"):
            if info.get(key):
                return (key, info[key], info.get("size"))
        return ("created", info.get("created"), info.get("size"))

    def identity(self, path: str) -> Any:
        info = self.info(path)
        return None if info is None else self.identity_of(info)

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError, OSError):
            self.fs.rm_file(self.strip(path))
        self._fresh(path)

    def remove_dir_if_empty(self, path: str) -> None:
        if _buffers_locally(self.fs):
            with contextlib.suppress(Exception):
                if not self.fs.ls(self.strip(path)):
                    self.fs.rmdir(self.strip(path))

    def abort_uploads(self, directory: str, keep: Callable[[str], bool]) -> None:
        """Aborts unfinished multipart uploads under `directory` whose object name `keep`
        rejects: what a killed writer leaves on S3 (invisible, but billed)."""
        list_uploads = getattr(self.fs, "list_multipart_uploads", None)
        if list_uploads is None:
            return
        bucket, _, prefix = self.strip(directory).partition("/")
        prefix = prefix.rstrip("/") + "/" if prefix else ""
        try:
            uploads = list_uploads(bucket)
        except Exception:
            return
        for upload in uploads or []:
            key = str(upload.get("Key", ""))
            if not key.startswith(prefix) or keep(key[len(prefix) :]):
                continue
            with contextlib.suppress(Exception):
                self.fs.abort_mpu(bucket, key, upload["UploadId"])


def _timestamp(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, datetime.datetime):
        return value.timestamp()
    return None


class _Buffer:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, chunk: Any) -> int:
        self.data += chunk
        return len(chunk)


def _buffers_locally(fs: Any) -> bool:
    from fsspec.implementations.memory import MemoryFileSystem

    return isinstance(fs, MemoryFileSystem)


# --------------------------------------------------------------------------------- resolving


_LOCAL = LocalStorage()


def is_url(path: str) -> bool:
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.replace("+", "").replace("-", "").isalnum()


def resolve(
    path: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    caller: str,
) -> tuple[Storage, str]:
    """The storage for a checkpoint location, and the location as that storage names it
    (a local path, or a URL). `storage_options` go to the fsspec filesystem (credentials,
    endpoint); the standard environment variables (`AWS_ENDPOINT_URL`, ...) apply too."""
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"{caller}: expected a path or URL string, got {text!r}.")
    if not is_url(text):
        return _LOCAL, text
    protocol = text.partition("://")[0].lower()
    if protocol in ("file", "local"):
        local = text.partition("://")[2]
        if not local.startswith("/"):
            raise ValueError(f"{caller}: {text!r} is not an absolute file:// URL.")
        return _LOCAL, local
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec is a dependency
        raise ImportError(f"{caller}: {text} needs fsspec: pip install fsspec") from None
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as error:
        extra = _EXTRAS.get(protocol)
        hint = (
            f"pip install 'eqx_train[{extra}]'" if extra else f"an fsspec backend for {protocol}://"
        )
        raise ImportError(
            f"{caller}: cannot open {text}: the {protocol}:// backend is not installed "
            f"({error}); install it with {hint}."
        ) from None
    options = dict(storage_options or {})
    if _accepts_listings_cache(cls):
        options.setdefault("use_listings_cache", False)
    fs = cls(**options)
    return ObjectStorage(protocol, fs), text.rstrip("/")


def _accepts_listings_cache(cls: type) -> bool:
    from fsspec.implementations.memory import MemoryFileSystem

    return not issubclass(cls, MemoryFileSystem)


def run_parallel(jobs: Sequence[Callable[[], Any]]) -> list[Any]:
    """Runs independent requests at once (object stores are latency-bound)."""
    if len(jobs) <= 1:
        return [job() for job in jobs]
    with ThreadPoolExecutor(max_workers=min(_MAX_REQUESTS, len(jobs))) as pool:
        return list(pool.map(lambda job: job(), jobs))
