"""Which storage a URL's scheme names: one table, filled with the built-in entries (local
paths and `file://`, the fsspec stores) by `_locations` and with a user's backends by
`register_storage`. A scheme in no entry that fsspec knows goes to fsspec, as before the
table existed; any other is refused naming `register_storage`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ..._calls import call
from ..._text import short
from ._base import Storage
from ._urls import plain_location

# (the URL as given, its scheme in lower case, what follows "://", storage_options) ->
# (the storage, the location as that storage names it).
Opener = Callable[[str, str, str, dict[str, Any]], tuple[Storage, str]]

_OPENERS: dict[str, Opener] = {}
_SCHEME = re.compile(r"[a-z][a-z0-9+-]*")
# Every name the checkpoint code calls on a storage: a factory's result must have them all.
_REQUIRED = (
    *("atomic_rename", "cheap_reads", "os_errors_mean_bad_media", "stale_by_age"),
    *("save_deadline", "join", "list", "find", "is_file", "is_dir", "exists", "makedirs"),
    *("start_deadline", "atomic_write", "open", "identity", "version", "remove", "move"),
    *("remove_dir_if_empty", "unfinished_uploads", "abort_upload"),
)


def register_storage(
    scheme: str, factory: Callable[..., Storage], *, replace: bool = False
) -> None:
    """Routes every checkpoint URL `scheme://...` to the storage `factory` builds.

    `factory(url, **storage_options)` is called by each checkpoint call on such a URL
    (`save_checkpoint`, `restore_checkpoint`, `CheckpointManager`...), with the URL as the
    user wrote it and the call's `storage_options`, and returns a `Storage` (a subclass of
    `StorageBase` writes five methods). The storage then sees paths that are that URL with
    names joined by `/`.

    **Arguments:**

    - `scheme`: the URL scheme, such as `"mystore"` for `mystore://bucket/run` (letters,
      digits, `+` and `-`, starting with a letter; case does not matter).
    - `factory`: a callable `factory(url, **storage_options) -> Storage`.
    - `replace`: replace the storage already registered for `scheme` (a built-in one such
      as `s3` included). Without it, registering a scheme twice is refused.

    **Returns:**

    Nothing.
    """
    if not isinstance(scheme, str) or not _SCHEME.fullmatch(scheme.lower()):
        raise ValueError(
            "register_storage: scheme must be a URL scheme such as 'mystore' (a letter, then "
            f"letters, digits, '+' or '-'), without '://', got {short(scheme)}."
        )
    if not callable(factory):
        raise TypeError(
            "register_storage: factory must be a callable factory(url, **storage_options) "
            f"returning a Storage, got {short(factory)}."
        )
    key = scheme.lower()
    if key in _OPENERS and not replace:
        raise ValueError(
            f"register_storage: the scheme {key!r} already has a storage registered; pass "
            "replace=True to replace it."
        )
    _OPENERS[key] = _user_opener(factory)


def add_builtin(scheme: str, opener: Opener) -> None:
    """Registers one of the library's own entries (`_locations`)."""
    _OPENERS[scheme] = opener


def is_registered(scheme: str) -> bool:
    return scheme.lower() in _OPENERS


def opener_for(url: str, scheme: str, fsspec_opener: Opener) -> Opener:
    """The entry of `scheme` (lower case); else `fsspec_opener` where fsspec knows the
    scheme; else `ImportError` naming the scheme and `register_storage`."""
    if scheme in _OPENERS:
        return _OPENERS[scheme]
    try:
        from fsspec.registry import known_implementations, registry

        # Built in, or registered at run time (`fsspec.register_implementation`).
        known = scheme in known_implementations or scheme in registry
    except ImportError:  # pragma: no cover - fsspec is a dependency
        known = False
    if known:
        return fsspec_opener
    raise ImportError(
        f"{call()}: cannot open {url}: no storage is registered for the scheme "
        f"'{scheme}://'. Register one with eqx_train.checkpoints.register_storage("
        f"{scheme!r}, factory), or install an fsspec backend for {scheme}://."
    )


def _user_opener(factory: Callable[..., Storage]) -> Opener:
    def open_location(
        url: str, scheme: str, rest: str, options: dict[str, Any]
    ) -> tuple[Storage, str]:
        rest = plain_location(url, rest)
        store = factory(url, **options)
        missing = [name for name in _REQUIRED if not hasattr(store, name)]
        if missing:
            raise TypeError(
                f"{call()}: the storage factory registered for {scheme}:// returned "
                f"{short(store)}, which is not a Storage (it lacks {', '.join(missing)}); "
                "return an instance of a subclass of "
                "eqx_train.checkpoints.storage.StorageBase."
            )
        return store, f"{scheme}://{rest}"

    return open_location
