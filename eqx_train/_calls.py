"""Which public call is in progress, for the messages of errors raised far below it, and
the `stacklevel` that points a warning at the user's own line.

A public call names itself once, where it crosses the API boundary
(`with calling("restore_checkpoint"):`); an error is worded with `call()` wherever it is
built, so no layer passes the name down. Work handed to another thread runs in the caller's
context through `in_context`.
"""

from __future__ import annotations

import contextvars
import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")

# The public call in progress in this context; the outermost one wins, so that an error of
# the `save_checkpoint` a manager's `save` runs names `CheckpointManager.save`.
_CALL: contextvars.ContextVar[str | None] = contextvars.ContextVar("eqx_train_call", default=None)


def call(default: str = "eqx_train") -> str:
    """The name of the public call in progress (`"restore_checkpoint"`,
    `"CheckpointManager.save"`), for an error message; `default` outside any."""
    return _CALL.get() or default


@contextmanager
def calling(name: str) -> Iterator[None]:
    """Within this block, errors name `name` as the public call, unless an outer public call
    already named itself."""
    token = _CALL.set(name) if _CALL.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _CALL.reset(token)


def in_context(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """`function`, to run on another thread (a pool, a background save) in the context of the
    thread that wraps it: its errors name the same public call."""
    name = _CALL.get()

    @functools.wraps(function)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        # Set per run, not by entering one copied Context: a pool runs the same wrapper on
        # several threads at once, and a Context can be entered by one thread at a time.
        token = _CALL.set(name)
        try:
            return function(*args, **kwargs)
        finally:
            _CALL.reset(token)

    return wrapper


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
# Run-time type checkers (jaxtyping's import hook, as the test suite runs) wrap each
# function of the package in frames of their own.
_WRAPPERS = ("jaxtyping", "beartype", "typeguard")


def outside_stacklevel(frame: Any) -> int:
    """The `stacklevel` of the first frame outside eqx_train, for a warning raised in
    `frame`: the user's call (of `restore_checkpoint`, a manager's `restore`...), however
    many of the package's own frames lie between."""
    level = 1
    while frame.f_back is not None and (
        os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE)
        or frame.f_code.co_filename.startswith("<@beartype")
        or str(frame.f_globals.get("__name__", "")).partition(".")[0] in _WRAPPERS
    ):
        frame, level = frame.f_back, level + 1
    return level
