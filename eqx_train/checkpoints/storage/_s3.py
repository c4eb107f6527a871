"""What only an S3 client (s3fs, or one that speaks its `call_s3`) adds to an fsspec store:
bounded client settings, a signature on every upload that proves a lost-answer commit
ours, aborting a multipart upload that failed, and listing the unfinished ones for cleanup.
Every other store goes without (`FsspecStorage` calls these; each is a no-op elsewhere).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

from ._client import timestamp
from ._items import Upload

# botocore settings (s3fs's `config_kwargs`) unless the caller sets them: a store that stops
# answering fails a request in seconds rather than after botocore's and s3fs's nested
# retries (25 attempts of 15 s each by default).
CLIENT_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 10,
    "read_timeout": 60,
    "retries": {"max_attempts": 3, "mode": "standard"},
}
# The user-metadata key under which every upload carries a random token (S3 lower-cases
# it): the upload's own signature, to recognise an object as ours when the store's answer
# was lost and the client's retry was refused.
UPLOAD_TOKEN = "eqx-train-upload"


@runtime_checkable
class Store(Protocol):
    """What these functions use of `_fsspec.FsspecStorage`, which calls them."""

    fs: Any
    is_async: bool

    def call(self, url: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...

    def strip(self, path: str) -> str: ...

    def join(self, directory: str, name: str) -> str: ...

    def remaining(self, url: str) -> float: ...

    def deadline_errors(self, url: str) -> AbstractContextManager[None]: ...

    def try_or_later(self, action: Callable[[Any], None]) -> None: ...


def is_s3fs(cls: type) -> bool:
    """Whether the filesystem class `cls` is (built on) s3fs."""
    return any(c.__module__.partition(".")[0] == "s3fs" for c in cls.__mro__)


def client_options(cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """`options` for the filesystem class `cls`, with `CLIENT_DEFAULTS` under the caller's
    own `config_kwargs` where `cls` is s3fs."""
    if is_s3fs(cls):
        # A deep copy: botocore rewrites the `retries` dict it is given in place.
        defaults = copy.deepcopy(CLIENT_DEFAULTS)
        options["config_kwargs"] = {**defaults, **(options.get("config_kwargs") or {})}
    return options


def upload_options(fs: Any, token: str) -> dict[str, Any]:
    """The keyword arguments an upload is opened with: s3fs sends them with its requests."""
    return {"Metadata": {UPLOAD_TOKEN: token}} if is_s3fs(type(fs)) else {}


def is_ours(store: Store, path: str, key: str, token: str) -> bool | None:
    """Whether the object `key` is the upload that carried `token`: False when it is absent
    or another's, or the store keeps no token; None when the store does not answer."""
    call = getattr(store.fs, "call_s3", None)
    if call is None or not is_s3fs(type(store.fs)):
        return False
    bucket, _, name = key.partition("/")
    try:
        head = store.call(path, call, "head_object", Bucket=bucket, Key=name)
    except FileNotFoundError:
        return False
    except Exception:
        return None
    return (head.get("Metadata") or {}).get(UPLOAD_TOKEN) == token


def bound_stream(store: Store, stream: Any, url: str) -> None:
    """Gives every request an s3fs upload stream makes the save's deadline too (its
    requests all go through its `_call_s3`, which hands `timeout` on to fsspec)."""
    inner = getattr(stream, "_call_s3", None)
    if inner is None or not store.is_async:
        return

    def bounded(method: str, *args: Any, **kwargs: Any) -> Any:
        with store.deadline_errors(url):
            return inner(method, *args, timeout=store.remaining(url), **kwargs)

    stream._call_s3 = bounded


def abort_multipart(store: Store, path: str, key: str, stream: Any) -> None:
    """Aborts the multipart upload `stream` began (if it began one), now or before the
    next write through the same client."""
    upload = getattr(stream, "mpu", None)
    if not (upload and upload.get("UploadId")):
        return
    bucket, _, name = key.partition("/")

    def abort(store: Store) -> None:
        store.call(path, store.fs.call_s3, "abort_multipart_upload", Bucket=bucket,
                   Key=name, UploadId=upload["UploadId"])  # fmt: skip

    store.try_or_later(abort)


def unfinished_uploads(store: Store, directory: str) -> list[Upload]:
    """The multipart uploads begun under `directory` and never completed, every page of
    the listing; none where the client has no S3 calls."""
    call = getattr(store.fs, "call_s3", None)
    if call is None:
        return []
    bucket, _, prefix = store.strip(directory).strip("/").partition("/")
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    found: list[Upload] = []
    markers: dict[str, str] = {}
    while True:
        try:
            page = store.call(
                directory, call, "list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers
            )
        except Exception:
            return found  # cleanup is best effort: a listing error never fails a save
        for upload in page.get("Uploads") or []:
            key = str(upload.get("Key", ""))
            if key.startswith(prefix) and upload.get("UploadId"):
                started = timestamp(upload.get("Initiated"))
                found.append(Upload(key[len(prefix) :], str(upload["UploadId"]), started))
        if not page.get("IsTruncated"):
            return found
        markers = {
            "KeyMarker": page.get("NextKeyMarker", ""),
            "UploadIdMarker": page.get("NextUploadIdMarker", ""),
        }
        if not markers["KeyMarker"]:
            return found


def abort_upload(store: Store, directory: str, upload: Upload) -> None:
    """Aborts `upload` (found by `unfinished_uploads` under `directory`)."""
    call = getattr(store.fs, "call_s3", None)
    if call is None:
        return
    bucket, _, prefix = store.strip(directory).strip("/").partition("/")
    key = (prefix.rstrip("/") + "/" if prefix else "") + upload.name
    try:
        store.call(
            store.join(directory, upload.name),
            call,
            "abort_multipart_upload",
            Bucket=bucket,
            Key=key,
            UploadId=upload.upload_id,
        )
    except Exception:
        pass  # already completed or aborted: nothing to do
