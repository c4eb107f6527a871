"""Where checkpoint bytes live: the `Storage` protocol and its capabilities,
`StorageBase` (a new backend writes five methods), `LocalStorage`, `FsspecStorage` (any
fsspec filesystem; S3's extra safety in `_s3`) and `register_storage`, which routes a URL
scheme to a backend. See the "Storage backends" page of the docs.
"""

from ._base import (
    Item as Item,
    ObjectReplacedError as ObjectReplacedError,
    Source as Source,
    Storage as Storage,
    StorageBase as StorageBase,
)
from ._fsspec import FsspecStorage as FsspecStorage
from ._local import LocalStorage as LocalStorage
from ._locations import resolve as _resolve  # noqa: F401  (fills the scheme table)
from ._registry import register_storage as register_storage

__all__ = [
    "FsspecStorage",
    "Item",
    "LocalStorage",
    "ObjectReplacedError",
    "Source",
    "Storage",
    "StorageBase",
    "register_storage",
]
