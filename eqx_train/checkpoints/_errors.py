"""The one error a checkpoint reader raises for a bad file, and the one way to build it.

Every reader (a single file, a `.shards` index and its pieces, a Hugging Face index, the
byte sources under them) reports what is wrong with a file as
`{path} is not a valid checkpoint: {why}.`, through `invalid`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


class CheckpointFormatError(ValueError):
    """A file is not a readable eqx_train/safetensors checkpoint (truncated, corrupt, foreign,
    or its contents fail their checksums)."""


class NewerFormatError(CheckpointFormatError):
    """A checkpoint was written by a newer eqx_train, in a format version this one cannot
    read. It is not corrupt: a manager never skips, moves aside or deletes it for that."""


def invalid(path: str, what: str = "checkpoint") -> Callable[[str], CheckpointFormatError]:
    """The error factory of one file: `invalid(path)(why)` is the `CheckpointFormatError`
    "`{path} is not a valid {what}: {why}.`"."""

    def bad(why: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{path} is not a valid {what}: {why}.")

    return bad


def short(value: Any, limit: int = 80) -> str:
    """`repr(value)`, cut to `limit` characters: error messages stay one line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
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
