"""What a storage lists: a name in a directory (`Item`) and an upload never completed
(`Upload`). Plain records, below every storage and every helper that handles them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Item:
    """One name in a listed directory, or what `StorageBase.info` says of one path.

    **Arguments:**

    - `name`: the name relative to the directory listed (for `info`, the last segment).
    - `path`: the full path or URL, as the storage names it.
    - `is_dir`: a directory (on an object store: a prefix with objects under it).
    - `is_file`: a regular file or an object (following symlinks).
    - `modified`: when it was last written, in seconds since the epoch, where known.
    - `identity`: what tells this version of the file from another one saved under its
      name (an ETag, a version counter), where known.
    - `size`: its size in bytes, where known (`info` of a file must say it).
    """

    name: str
    path: str
    is_dir: bool
    is_file: bool
    modified: float | None = None
    identity: Any = None
    size: int | None = None


@dataclass(frozen=True)
class Upload:
    """An upload begun and never completed (multipart, on S3): invisible, but billed."""

    name: str  # the object's key relative to the directory listed: "a" or "a/b"
    upload_id: str
    started: float | None  # POSIX time
