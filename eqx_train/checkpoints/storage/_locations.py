"""Which storage a checkpoint location names, and the library's own entries in the scheme
table (`_registry`): a local path (or `file://` URL) is the local disk (`LocalStorage`);
`s3://`, `gs://`, `memory://` and any other scheme fsspec knows are fsspec stores
(`FsspecStorage`) built with `storage_options`; a scheme registered with `register_storage`
is the storage its factory builds. URLs that a store would silently rewrite are refused
here, before anything is written.
"""

from __future__ import annotations

import math
import numbers
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..._calls import call
from . import _registry, _s3
from ._base import Storage
from ._fsspec import DEFAULT_DEADLINE_S, FsspecStorage
from ._local import LocalStorage
from ._urls import is_url, plain_location

# The fsspec protocols eqx_train knows, and the extra that installs each one's client.
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}

_LOCAL = LocalStorage()
_COLLAPSED_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):/(?!/)")


def resolve(
    path: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[Storage, str]:
    """The storage for a checkpoint location, and the location as that storage names it
    (a local path, or a URL), routed by the URL's scheme through the scheme table.
    `storage_options` go to the storage's factory (for fsspec: the filesystem's
    credentials, endpoint..., except `deadline_s`, how long one save may spend on
    requests); the standard environment variables (`AWS_ENDPOINT_URL`, ...) apply too. A
    URL whose key the store would rewrite (`a//b`, `a\\b`, `./`, `../`, a name ending in
    `.`) is refused."""
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"{call()}: expected a path or URL string, got {text!r}.")
    if not is_url(text):
        collapsed = _COLLAPSED_URL.match(text)
        if collapsed and not isinstance(path, str) and _registry.is_registered(collapsed[1]):
            raise ValueError(
                f"{call()}: {text!r} looks like a URL that pathlib collapsed ('//' "
                "became '/'); pass URLs as strings."
            )
        return _LOCAL, text
    scheme, _, rest = text.partition("://")
    protocol = scheme.lower()
    opener = _registry.opener_for(text, protocol, _open_fsspec)
    return opener(text, protocol, rest, dict(storage_options or {}))


def _open_file(url: str, scheme: str, rest: str, options: dict[str, Any]) -> tuple[Storage, str]:
    if not rest.startswith("/"):
        raise ValueError(f"{call()}: {url!r} is not an absolute file:// URL.")
    return _LOCAL, rest


def _open_fsspec(
    url: str, protocol: str, rest: str, options: dict[str, Any]
) -> tuple[Storage, str]:
    """An fsspec filesystem for `protocol`, built with `options` (s3fs's with bounded
    client settings)."""
    rest = plain_location(url, rest)
    if protocol in _EXTRAS and not rest.lstrip("/"):
        raise ValueError(f"{call()}: {url!r} names no bucket; expected {protocol}://bucket/run.")
    deadline_s = _deadline(options.pop("deadline_s", DEFAULT_DEADLINE_S))
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec is a dependency
        raise ImportError(f"{call()}: {url} needs fsspec: pip install fsspec") from None
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as error:
        extra = _EXTRAS.get(protocol)
        hint = (
            f"pip install 'eqx_train[{extra}]'" if extra else f"an fsspec backend for {protocol}://"
        )
        raise ImportError(
            f"{call()}: cannot open {url}: the {protocol}:// backend is not installed "
            f"({error}); install it with {hint}."
        ) from None
    if _accepts_listings_cache(cls):
        options.setdefault("use_listings_cache", False)
    fs = cls(**_s3.client_options(cls, options))
    return FsspecStorage(protocol, fs, deadline_s=deadline_s), f"{protocol}://{rest}"


def _deadline(value: Any) -> float:
    # Any real number (NumPy's too, as read from a config), but not a bool: `True` is 1 s.
    if (
        isinstance(value, bool | np.bool_)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"{call()}: storage_options['deadline_s'] must be a positive number of seconds, "
            f"got {value!r}."
        )
    return float(value)


def _accepts_listings_cache(cls: type) -> bool:
    from fsspec.implementations.memory import MemoryFileSystem

    return not issubclass(cls, MemoryFileSystem)


for _scheme in ("file", "local"):
    _registry.add_builtin(_scheme, _open_file)
for _scheme in (*_EXTRAS, "memory"):
    _registry.add_builtin(_scheme, _open_fsspec)
