"""Which storage a checkpoint location names: a local path (or `file://` URL) is the
local disk (`_storage.LocalStorage`), any other URL an object store
(`_object_storage.ObjectStorage`) built through fsspec with `storage_options`. URLs that a
store would silently rewrite are refused here, before anything is written.
"""

from __future__ import annotations

import copy
import math
import numbers
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._object_storage import DEFAULT_DEADLINE_S, ObjectStorage
from ._storage import LocalStorage, Storage

# The fsspec protocols eqx_train knows, and the extra that installs each one's client.
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
# botocore settings (s3fs's `config_kwargs`) unless the caller sets them: a store that stops
# answering fails a request in seconds rather than after botocore's and s3fs's nested
# retries (25 attempts of 15 s each by default).
_CLIENT_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 10,
    "read_timeout": 60,
    "retries": {"max_attempts": 3, "mode": "standard"},
}

_LOCAL = LocalStorage()
_URL_SCHEMES = {*_EXTRAS, "memory", "file", "local"}
_COLLAPSED_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):/(?!/)")


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
    endpoint), except `deadline_s` (how long one save may spend on requests); the standard
    environment variables (`AWS_ENDPOINT_URL`, ...) apply too. A URL whose key the store
    would rewrite (`a//b`, `a\\b`, `./`, `../`, a name ending in `.`) is refused."""
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"{caller}: expected a path or URL string, got {text!r}.")
    if not is_url(text):
        collapsed = _COLLAPSED_URL.match(text)
        if collapsed and not isinstance(path, str) and collapsed[1].lower() in _URL_SCHEMES:
            raise ValueError(
                f"{caller}: {text!r} looks like a URL that pathlib collapsed ('//' became "
                "'/'); pass URLs as strings."
            )
        return _LOCAL, text
    scheme, _, rest = text.partition("://")
    protocol = scheme.lower()
    if protocol in ("file", "local"):
        if not rest.startswith("/"):
            raise ValueError(f"{caller}: {text!r} is not an absolute file:// URL.")
        return _LOCAL, rest
    if "?" in rest or "#" in rest:
        raise ValueError(
            f"{caller}: {text!r} has a query or fragment ('?' or '#'); checkpoint URLs are "
            "plain locations such as s3://bucket/run (options go in storage_options=)."
        )
    rest = rest.rstrip("/")
    if protocol in _EXTRAS and not rest.lstrip("/"):
        raise ValueError(f"{caller}: {text!r} names no bucket; expected {protocol}://bucket/run.")
    if rest:  # not the root of a memory store
        _check_key(text, rest[1:] if protocol == "memory" and rest[0] == "/" else rest, caller)
    options = dict(storage_options or {})
    deadline_s = _deadline(options.pop("deadline_s", DEFAULT_DEADLINE_S), caller)
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
    if _accepts_listings_cache(cls):
        options.setdefault("use_listings_cache", False)
    if any(c.__module__.partition(".")[0] == "s3fs" for c in cls.__mro__):
        # A deep copy: botocore rewrites the `retries` dict it is given in place.
        defaults = copy.deepcopy(_CLIENT_DEFAULTS)
        options["config_kwargs"] = {**defaults, **(options.get("config_kwargs") or {})}
    fs = cls(**options)
    return ObjectStorage(protocol, fs, deadline_s=deadline_s), f"{protocol}://{rest}"


def _check_key(url: str, rest: str, caller: str) -> None:
    """Refuses a location that an object store would not keep as written. Stores rewrite
    some keys (SeaweedFS turns `a//b` and `a\\b` into `a/b`; S3 clients and servers treat
    `.` and `..` segments differently; some stores drop a trailing `.`): a save would then
    land under another key, a listing would find nothing, and two such URLs could collide."""
    segments = rest.split("/")
    problems = [
        ("a backslash", "\\" in rest),
        ("an empty path segment ('//')", any(not part for part in segments)),
        ("a '.' or '..' segment", any(part in (".", "..") for part in segments)),
        ("a segment ending in '.'", any(part.endswith(".") for part in segments)),
        ("a control character", any(ord(c) < 32 or ord(c) == 127 for c in rest)),
    ]
    found = [what for what, present in problems if present]
    if found:
        raise ValueError(
            f"{caller}: {url!r} has {found[0]}; object stores rewrite such keys, so the "
            "checkpoints would land under another name and a resume would not find them. "
            "Use plain segments separated by single '/'."
        )


def _deadline(value: Any, caller: str) -> float:
    # Any real number (NumPy's too, as read from a config), but not a bool: `True` is 1 s.
    if (
        isinstance(value, bool | np.bool_)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"{caller}: storage_options['deadline_s'] must be a positive number of seconds, "
            f"got {value!r}."
        )
    return float(value)


def _accepts_listings_cache(cls: type) -> bool:
    from fsspec.implementations.memory import MemoryFileSystem

    return not issubclass(cls, MemoryFileSystem)
