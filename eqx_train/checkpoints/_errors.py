"""The checkpoint package's errors and warnings, every one a user may catch or filter.

Every reader (a single file, a `.shards` index and its pieces, a Hugging Face index, the
byte sources under them) reports what is wrong with a file as
`{path} is not a valid checkpoint: {why}.`, through `invalid`.

Errors name the public call the user made (`restore_checkpoint: ...`) through
`eqx_train._calls`, re-exported here for the engine's modules that build errors.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Literal

from .._calls import (
    call as call,
    calling as calling,
    in_context as in_context,
    outside_stacklevel as outside_stacklevel,
)
from .._text import short as short


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
