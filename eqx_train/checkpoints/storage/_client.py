"""How an fsspec client's answers are read: its errors as `OSError`s naming the URL,
its timestamps, whether it is asynchronous (then it takes a `timeout` per request)."""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from typing import Any

_CLIENT_MODULES = {"botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "google"}


@contextlib.contextmanager
def client_errors(url: str) -> Iterator[None]:
    """Errors of the object-store client (botocore's `NoCredentialsError`, a refused
    connection...) become `OSError`s that name the URL; `OSError`s that do not name it (s3fs
    turns a 403 into `PermissionError: Forbidden`) get it added and keep their type."""
    try:
        yield
    except OSError as error:
        if url in str(error):
            raise
        raise _naming(error, url) from error
    except Exception as error:
        if type(error).__module__.partition(".")[0] not in _CLIENT_MODULES:
            raise
        raise OSError(f"{url}: {type(error).__name__}: {error}") from error


def _naming(error: OSError, url: str) -> OSError:
    """`error` with `url` in front of its message, of the same type where that type can be
    built from a message (so `except PermissionError` / `FileNotFoundError` still work)."""
    message = f"{url}: {error}"
    try:
        named = type(error)(message)
    except Exception:
        return OSError(error.errno, message) if error.errno is not None else OSError(message)
    if error.errno is not None and named.errno is None:
        named.errno = error.errno
    return named


def timestamp(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, datetime.datetime):
        return value.timestamp()
    return None


def is_async(fs: Any) -> bool:
    from fsspec.asyn import AsyncFileSystem

    return isinstance(fs, AsyncFileSystem)


def client_key(fs: Any) -> Any:
    return getattr(fs, "_fs_token", None) or id(fs)
