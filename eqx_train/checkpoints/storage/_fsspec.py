"""Any fsspec filesystem as a `Storage` (`s3://bucket/run`, `gs://bucket/run`,
`memory://run`, or a protocol registered with fsspec): a store that has no rename.

An object appears atomically when its upload completes, so a file is uploaded straight
under its final name (multipart for large ones); an upload that fails is aborted, and one
whose writer was killed stays invisible. Every request has a deadline, reads are batched
byte ranges, and a reader checks at the end that the object it read was not replaced. What
only an S3 client can do (conditional-write proof, multipart listing and aborts) is in
`_s3`.
"""

from __future__ import annotations

import contextlib
import errno
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from .._errors import invalid
from . import _s3
from ._base import BytesSink, Item, ObjectReplacedError, Source, Upload, Writer
from ._client import client_errors, client_key, is_async, timestamp
from ._temp import temp_name

_PART_BYTES = 64 << 20  # multipart upload part size
_READ_BYTES = 16 << 20  # bytes per ranged request; requests run in parallel
_MERGE_GAP = 64 << 10  # neighbouring ranges closer than this are fetched by one request
# How long one save may spend on object-store requests, unless `storage_options` says
# otherwise ("deadline_s"); every request is also bounded on its own
# (`_s3.CLIENT_DEFAULTS`).
DEFAULT_DEADLINE_S = 1800.0


class FsspecSource:
    """An object: its size and ETag read once, then byte-range requests, several in
    parallel. Object stores cannot pin a version for plain range reads, so a reader calls
    `check_unchanged` after its last read: if the object was replaced meanwhile (an
    overwrite of the same step), it raises `ObjectReplacedError` and the restore starts
    again on the new version."""

    cheap_reads = False

    def __init__(self, store: FsspecStorage, path: str, bad: Callable[[str], Exception]):
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
        store = self._store
        path = store.strip(self.path)
        with client_errors(self.path):
            results = store.call(
                self.path,
                store.fs.cat_ranges,
                [path] * len(spans),
                [s for s, _, _ in spans],
                [e for _, e, _ in spans],
            )
            for data in results:
                if isinstance(data, BaseException):
                    raise data
        for (start, end, members), data in zip(spans, results, strict=True):
            if len(data) != end - start:
                raise self._bad("it ended early (truncated)")
            whole = memoryview(data)
            for offset, view in members:
                view[:] = whole[offset - start : offset - start + len(view)]

    def check_unchanged(self) -> None:
        """Raises `ObjectReplacedError` if the object is no longer the version opened, so
        bytes read from it may mix two versions."""
        if self._store.identity(self.path) != self.identity:
            raise ObjectReplacedError(
                f"{self.path} was replaced or removed while it was being read"
            )

    def close(self) -> None:
        pass


class _ConditionRefused(Exception):
    """The store does not implement conditional writes (If-None-Match)."""


class FsspecStorage:
    """An fsspec filesystem (a bucket, the fsspec memory store...) as a `Storage`,
    addressed by URLs `protocol://bucket/key`.

    Every request has a deadline: the client's own per-request timeouts and retries, and
    `deadline_s` for all the requests of one save (from `start_deadline()`), or for each
    request on its own outside a save. A request still unanswered then is cancelled, and
    raises `TimeoutError` naming the URL.

    **Arguments:**

    - `protocol`: the URL scheme its paths carry (`"s3"`).
    - `fs`: the fsspec filesystem instance.
    - `deadline_s`: the time budget of one save's requests, in seconds.
    """

    atomic_rename = False
    cheap_reads = False
    os_errors_mean_bad_media = False
    stale_by_age = True
    save_deadline = True

    def __init__(self, protocol: str, fs: Any, *, deadline_s: float = DEFAULT_DEADLINE_S):
        self.protocol = protocol
        self.fs = fs
        self.deadline_s = deadline_s
        self._ends: float | None = None  # time.monotonic() when this save's budget runs out
        self._conditional = True  # until the store answers that it has no conditional writes
        self.is_async = is_async(fs)  # then each request takes a `timeout`

    def start_deadline(self) -> None:
        """Starts the budget of one save: from now on, all requests together have
        `deadline_s` seconds."""
        self._ends = time.monotonic() + self.deadline_s

    def remaining(self, url: str) -> float:
        if self._ends is None:
            return self.deadline_s
        left = self._ends - time.monotonic()
        if left <= 0:
            raise self._expired(url)
        return left

    def _expired(self, url: str) -> TimeoutError:
        return TimeoutError(
            f"{url}: the object store did not answer within the deadline of "
            f"{self.deadline_s:g} s (set it with storage_options={{'deadline_s': ...}}); "
            "what was committed before is intact, and the next save cleans up."
        )

    def call(self, url: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`method(*args, **kwargs)` of the filesystem, for `url`, cancelled when the
        deadline passes (fsspec's asynchronous filesystems take a `timeout`)."""
        timeout = self.remaining(url)
        if self.is_async:
            kwargs["timeout"] = timeout
        with client_errors(url), self.deadline_errors(url):
            return method(*args, **kwargs)

    @contextlib.contextmanager
    def deadline_errors(self, url: str) -> Iterator[None]:
        from fsspec.exceptions import FSTimeoutError

        try:
            yield
        except FSTimeoutError as error:  # fsspec cancelled the request at the deadline
            raise self._expired(url) from error

    def strip(self, path: str) -> str:
        return self.fs._strip_protocol(path)

    def join(self, directory: str, name: str) -> str:
        if directory.endswith("://"):  # the root of a store (memory://)
            return directory + name
        return directory.rstrip("/") + "/" + name

    def _fresh(self, path: str) -> None:
        # fsspec caches listings; a checkpoint listing must see other writers' commits.
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(self.strip(path))

    def list(self, directory: str) -> list[Item]:
        self._fresh(directory)
        try:
            entries = self.call(directory, self.fs.ls, self.strip(directory), detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        base = self.strip(directory).rstrip("/")
        items = []
        for e in entries:
            name = str(e["name"]).rstrip("/").rsplit("/", 1)[-1]
            if str(e["name"]).rstrip("/") == base:
                continue  # some stores list a "directory" marker object as itself
            kind = e.get("type")
            modified = timestamp(e.get("LastModified") or e.get("mtime") or e.get("created"))
            items.append(
                Item(
                    name, self.join(directory, name), kind == "directory", kind == "file", modified
                )
            )
        return items

    def find(self, directory: str, prefix: str) -> list[Item]:
        """Every object whose key relative to `directory` starts with `prefix`, at any
        depth (names relative to `directory`): one listing request per 1000 keys on S3
        (no delimiter; the store filters by prefix), however many checkpoints there are."""
        self._fresh(directory)
        base = self.strip(directory).rstrip("/")
        try:
            try:
                entries = self.call(directory, self.fs.find, base, prefix=prefix, detail=True)
            except TypeError:  # a client whose find has no prefix filter
                entries = self.call(directory, self.fs.find, base, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        items = []
        for key, e in sorted(entries.items()):
            name = str(key).removeprefix(base + "/")
            if e.get("type") != "file" or name == str(key) or not name.startswith(prefix):
                continue
            modified = timestamp(e.get("LastModified") or e.get("mtime") or e.get("created"))
            items.append(
                Item(name, self.join(directory, name), False, True, modified, self.identity_of(e))
            )
        return items

    def info(self, path: str) -> dict[str, Any] | None:
        self._fresh(path)
        try:
            return self.call(path, self.fs.info, self.strip(path))
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
        conditional write (S3's `If-None-Match`) where the client has one, and by a check
        just before committing in any case.

        Every upload carries a random token in its user metadata. When the store committed
        it but its answer was lost, the client retries by itself, and the retry is refused
        (412: the object now exists; or "no such upload" for a completed multipart upload):
        the token on the object then proves the upload ours, and the write succeeded.

        An upload big enough to go in parts first writes an empty marker object named like
        a local temporary file (`.{name}.tmp-{host}-{pid}-{random}`), removed once the
        upload is over: it says who is uploading, so that cleanup aborts only the
        unfinished uploads of writers that are gone (`_directory.remove_leftovers`). What a
        failed upload could not remove (the store stopped answering) is removed by the next
        write through the same client."""
        key = self.strip(path)
        self._finish_cleanup(path)
        if not replace and self.exists(path):
            raise FileExistsError(path)
        if _buffers_locally(self.fs):
            # The memory store commits a file the moment it is opened: build the bytes
            # first, then put them in one step (under a lock: the store lives in this
            # process, so the check and the put are then one step for every writer).
            buffer = BytesSink()
            write(buffer)
            with _MEMORY_LOCK:
                if not replace and self.exists(path):
                    raise FileExistsError(path)
                self.call(path, self.fs.pipe_file, key, bytes(buffer.data))
            return
        with client_errors(path):
            self._upload(path, key, write, replace)
        self._fresh(path)

    def _upload(self, path: str, key: str, write: Writer, replace: bool) -> None:
        try:
            self._upload_once(path, key, write, replace, not replace and self._conditional)
        except _ConditionRefused:
            # The store does not do conditional writes: from now on rely on the check just
            # before completing.
            self._conditional = False
            self._upload_once(path, key, write, replace, False)

    def _upload_once(
        self, path: str, key: str, write: Writer, replace: bool, conditional: bool
    ) -> None:
        head, _, name = path.rpartition("/")
        marker = _UploadMarker(self, f"{head}/{temp_name(name)}")
        token = secrets.token_hex(16)
        stream = self._open_for_upload(key, conditional, token)
        _s3.bound_stream(self, stream, path)
        try:
            write(_MarkedStream(stream, marker))
            if not replace and self.exists(path):
                raise FileExistsError(path)
            try:
                stream.close()
            except Exception as error:
                ours = self._is_ours(path, key, token)
                if ours:
                    return  # committed; only the store's answer was lost
                if ours is None:
                    raise  # no answer to "whose is it": not proof of a concurrent save
                # The store refused the completion: S3 answers a failed If-None-Match with
                # "412 Precondition Failed", which clients report in various ways.
                if not replace and self.exists(path):
                    raise FileExistsError(path) from None
                if conditional and getattr(error, "errno", None) in (
                    errno.ENOSYS,
                    errno.EOPNOTSUPP,
                ):
                    raise _ConditionRefused from error  # "501 Not Implemented"
                raise
        except BaseException:
            # A discarded file must never be closed: closing commits what was written (its
            # finaliser would try to).
            was_closed, stream.closed = stream.closed, True
            if not was_closed or getattr(stream, "mpu", None):
                self._abort_key(path, key, stream)  # a refused completion leaves parts
            raise
        finally:
            marker.remove()

    def _open_for_upload(self, key: str, conditional: bool, token: str) -> Any:
        # s3fs sends extra keyword arguments with the upload's requests.
        signed = _s3.upload_options(self.fs, token)
        if conditional:
            with contextlib.suppress(ValueError, NotImplementedError, TypeError):
                # "xb": the client asks the store to refuse the completion if the object
                # exists by then (s3fs sends If-None-Match: *).
                return self.fs.open(key, "xb", block_size=_PART_BYTES, **signed)
        return self.fs.open(key, "wb", block_size=_PART_BYTES, **signed)

    def _is_ours(self, path: str, key: str, token: str) -> bool | None:
        """Whether the object `key` is the upload that carried `token`: False when it is
        absent or another's, or the store keeps no token; None when the store does not
        answer."""
        return _s3.is_ours(self, path, key, token)

    def _abort_key(self, path: str, key: str, stream: Any) -> None:
        _s3.abort_multipart(self, path, key, stream)

    def try_or_later(self, action: Callable[[FsspecStorage], None]) -> None:
        """Runs a cleanup request now, or (when the store does not answer) before the next
        write through this client (under that write's deadline)."""
        try:
            action(self)
        except FileNotFoundError:
            pass  # already gone
        except Exception:
            with _PENDING_LOCK:
                pending = _PENDING.setdefault(client_key(self.fs), [])
                if len(pending) < _MAX_PENDING:
                    pending.append(action)

    def _finish_cleanup(self, url: str) -> None:
        with _PENDING_LOCK:
            actions = _PENDING.pop(client_key(self.fs), [])
        for action in actions:
            self.try_or_later(action)

    def open(self, path: str) -> Source:
        return FsspecSource(self, path, invalid(path))

    @staticmethod
    def identity_of(info: Mapping[str, Any]) -> Any:
        for key in ("ETag", "etag", "md5Hash", "generation", "VersionId"):
            if info.get(key):
                return (key, info[key], info.get("size"))
        return ("created", info.get("created"), info.get("size"))

    def identity(self, path: str) -> Any:
        info = self.info(path)
        return None if info is None else self.identity_of(info)

    def version(self, path: str) -> Any:
        return self.identity(path)

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError, OSError):
            self.call(path, self.fs.rm_file, self.strip(path))
        self._fresh(path)

    def move(self, path: str, new_path: str) -> None:
        """Copies the object `path` to `new_path` (which must not exist), then removes it:
        an object store has no rename (nor directories: move each object of one)."""
        if self.exists(new_path):
            raise FileExistsError(f"{new_path} already exists")
        self.call(path, self.fs.cp_file, self.strip(path), self.strip(new_path))
        self._fresh(new_path)
        self.remove(path)

    def remove_dir_if_empty(self, path: str) -> None:
        if _buffers_locally(self.fs):
            with contextlib.suppress(Exception):
                if not self.fs.ls(self.strip(path)):
                    self.fs.rmdir(self.strip(path))

    def unfinished_uploads(self, directory: str) -> list[Upload]:
        """The multipart uploads begun under `directory` and never completed (S3; other
        stores either have none or expire them themselves)."""
        return _s3.unfinished_uploads(self, directory)

    def abort_upload(self, directory: str, upload: Upload) -> None:
        _s3.abort_upload(self, directory, upload)


# Cleanup requests (aborting an upload, removing its marker) that failed because the store
# did not answer, per client: the next write through that client runs them first.
_PENDING: dict[Any, list[Callable[[FsspecStorage], None]]] = {}
_PENDING_LOCK = threading.Lock()
_MAX_PENDING = 1000


class _UploadMarker:
    """The empty object that names the writer of a multipart upload in progress; written
    just before the upload's first part, removed when the upload is over."""

    def __init__(self, store: FsspecStorage, path: str):
        self.store, self.path, self.written = store, path, False

    def write(self) -> None:
        store = self.store
        store.call(self.path, store.fs.pipe_file, store.strip(self.path), b"")
        self.written = True

    def remove(self) -> None:
        # Best effort: a marker left behind is removed by cleanup once its writer is gone
        # (or by this client's next write, if the store stopped answering), and must neither
        # fail a committed upload nor hide the error of a failed one.
        if self.written:
            path = self.path

            def remove(store: FsspecStorage) -> None:
                store.call(path, store.fs.rm_file, store.strip(path))

            self.store.try_or_later(remove)


class _MarkedStream:
    """An upload stream that writes the upload's marker before the first part goes out
    (the client starts a multipart upload once it holds `_PART_BYTES`): small uploads are
    one request, and need no marker."""

    def __init__(self, stream: Any, marker: _UploadMarker):
        self._stream, self._marker, self._held = stream, marker, 0

    def write(self, chunk: Any) -> int:
        before = self._held // _PART_BYTES
        self._held += memoryview(chunk).nbytes
        if self._held // _PART_BYTES > before:
            # Before each part: the marker's age is the time since the writer last made
            # progress, so cleanup elsewhere never takes a long live upload for a dead one.
            self._marker.write()
        return self._stream.write(chunk)


_MEMORY_LOCK = threading.Lock()


def _buffers_locally(fs: Any) -> bool:
    from fsspec.implementations.memory import MemoryFileSystem

    return isinstance(fs, MemoryFileSystem)
