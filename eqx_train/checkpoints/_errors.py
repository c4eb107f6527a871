"""The one error a checkpoint reader raises for a bad file, and the one way to build it.

Every reader (a single file, a `.shards` index and its pieces, a Hugging Face index, the
byte sources under them) reports what is wrong with a file as
`{path} is not a valid checkpoint: {why}.`, through `invalid`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class CheckpointFormatError(ValueError):
    """A file is not a readable eqx_train/safetensors checkpoint (truncated, corrupt, foreign,
    or its contents fail their checksums)."""


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
