"""The checkpoint package's errors, and how they learn which public call they come from.

Every reader (a single file, a `.shards` index and its pieces, a Hugging Face index, the
byte sources under them) reports what is wrong with a file as
`{path} is not a valid checkpoint: {why}.`, through `invalid`.

Errors name the public call the user made (`restore_checkpoint: ...`). That name is set
once, where the call crosses the API boundary (`with calling("restore_checkpoint"):`), and
read where an error is built (`call()`); no layer below passes it on. Work handed to
another thread runs in the caller's context through `in_context`.
"""

from __future__ import annotations

import contextvars
import errno
import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, ParamSpec, TypeVar

from .._text import short as short

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


class ObjectReplacedError(FileNotFoundError):
    """The version of a file being read is gone (overwritten or deleted meanwhile)."""


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


# ------------------------------------------------------------------ the public errors and warnings
# Every error and warning a user may catch or filter is defined here, whatever layer raises
# it, so that one module lists them all (and no layer imports another to name one).


class StepExistsError(FileExistsError, ValueError):
    """A save was refused because a checkpoint at its step, or a newer one, already exists
    (pass `overwrite=True` to replace it). A `FileExistsError`, and a `ValueError` as this
    error was before it had its own type."""


class StepNotFoundError(FileNotFoundError, ValueError):
    """The checkpoint step asked for (a step number, the latest, or `"best"`) is not in the
    directory; the message names the steps that are. A `FileNotFoundError`, and a
    `ValueError` as this error was before it had its own type."""


class PartialRestoreWarning(UserWarning):
    """A restore with `strict=False` left some target leaves with the target's values (the
    checkpoint has no tensor for them) or left some saved tensors unused; or a restore into
    an abstract target (`jax.ShapeDtypeStruct` leaves) returns some of them unfilled, as
    placeholders (left out by `filter_spec` or `rename`, or missing with `strict=False`).

    The message says how many of each and names the first few. `plan_restore` lists them
    all before restoring; `warnings.simplefilter("ignore", PartialRestoreWarning)` silences
    a restore whose partiality is intended.
    """


class ConfigMismatchWarning(UserWarning):
    """A restore kept the target's configuration (the Python `bool`/`int`/`float` fields of
    its Equinox modules, e.g. `Dropout.p`, `inference`) where the file saved other values.

    The message names every such leaf with both values. Pass `config="saved"` to take the
    file's values instead, or turn this warning into an error with `warnings.simplefilter`.
    """


class UnreadableCheckpointWarning(UserWarning):
    """A checkpoint in a manager's directory could not be read: while ranking by metric it
    counts as having no metric (it is kept only as one of the latest); when
    `CheckpointManager.restore` finds the latest corrupt, it restores the newest older one
    that verifies instead, moves each one skipped aside (to `corrupt-<its name>`, which no
    listing counts), and this warning names each one skipped and where it went."""


class BarrierTimeoutError(TimeoutError):
    """A multi-process operation waited longer than its timeout for its peers; the message
    names the processes that did not arrive (`late`: whether this process was one of them,
    arriving after a peer had given up)."""

    late: bool = False


# What a local read error says when the checkpoint's own bytes are unreadable: a failing
# disk (EIO), or a file system that found them corrupt (Linux's EFSBADCRC and EFSCORRUPTED
# are EBADMSG and EUCLEAN). Any other OSError (too many open files, no memory, a permission,
# an interrupted call) is about the process or the machine, not the checkpoint: a manager's
# fallback would restore an older step and move a good newest checkpoint aside, and its
# retention would count the best checkpoint as having no metric and delete it.
UNREADABLE_ERRNOS = frozenset(
    getattr(errno, name) for name in ("EIO", "EBADMSG", "EUCLEAN") if hasattr(errno, name)
)

Foreign = Literal["flax", "orbax", "torch", "hf-index", "json", "safetensors"]
TORCH_HOW = (
    "load it with torch.load(path, weights_only=True) and pass the state dict to "
    "eqx_train.interop.from_state_dict(target, state_dict)"
)
# What reads each kind of foreign weights: the end of a `ForeignCheckpointError`'s message.
_HOW: dict[str, str] = {
    "flax": (
        "read it with eqx_train.interop.load_flax_checkpoint (it takes the same target, "
        "strict, rename, casting and filter_spec), or convert it with `eqx-train convert-flax`"
    ),
    "orbax": (
        "read it with eqx_train.interop.load_orbax_checkpoint (it takes the same target, "
        "strict, rename, casting and filter_spec), or convert it with `eqx-train convert-orbax`"
    ),
    "torch": TORCH_HOW,
}


class ForeignCheckpointError(CheckpointFormatError):
    """`path` holds weights that this call does not read (`kind`: flax msgpack, Orbax, a
    PyTorch pickle...); the message names the call that reads them."""

    def __init__(self, path: str, kind: Foreign, what: str, how: str = ""):
        self.path, self.kind, self.what = path, kind, what
        how = how or _HOW.get(kind, "")
        super().__init__(
            f"{path} is {what}, not an eqx_train or safetensors checkpoint"
            + (f": {how}." if how else ".")
        )
