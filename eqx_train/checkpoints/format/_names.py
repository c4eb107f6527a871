"""Every name the checkpoint code puts on disk, and how to read one back.

One module names them all, so that the writer, the readers, listing, retention and cleanup
can never disagree about what a name means. File names:

- `{prefix}{step}.safetensors`: a single-file checkpoint.
- `{prefix}{step}.shards/`: a multi-process checkpoint, committed when its `index.safetensors`
  exists; its piece files are `process_{i:05d}.{token}.safetensors`, and the tensors in them
  `{leaf}#{process}.{k}`.
- `.{final}.tmp-{writer}-{random}`: a file being written; renamed over `final` when done (on
  an object store: the empty marker naming the writer of a multipart upload).
- `.done-{i:05d}.{token}` inside a `.shards` directory: written by versions before the
  coordination service replaced them; cleanup still recognises (and removes) them.
- `model.safetensors`, or `model-{i:05d}-of-{n:05d}.safetensors` and
  `model.safetensors.index.json`: the Hugging Face layout (`eqx_train.interop.save_sharded`).

`{step}` is the canonical spelling of the step (`canonical_step`): one number, one name.
`{writer}` is `{host}-{pid}` of the process that may clean the name up if it dies, and
`{token}` of a multi-process save starts with process 0's `{writer}`.

Names inside a file: the safetensors header's `__metadata__` keys and format markers
(`*_KEY`, `FORMAT_*`, `HF_*`) live in `_keys` and are re-exported here; see
docs/checkpoint_format.md.
"""

from __future__ import annotations

import math
import os
import re
from decimal import Decimal
from typing import Any, TypeAlias

import numpy as np

from ..._calls import call

# The names of what a storage writes before it is visible (temporaries, upload markers).
from ..storage._temp import (
    TEMP_MARK as TEMP_MARK,
    WRITER as _WRITER,
    host_id as host_id,
    parse_temp as parse_temp,
    temp_name as temp_name,
    writer_id as writer_id,
)

# The names inside a file's header, beside the names of files.
from ._keys import (
    ARRAYS_KEY as ARRAYS_KEY,
    CHECKSUM_ALGORITHM as CHECKSUM_ALGORITHM,
    CHECKSUMS_KEY as CHECKSUMS_KEY,
    COMPLEX128_KEY as COMPLEX128_KEY,
    FORMAT_KEY as FORMAT_KEY,
    FORMAT_NAME as FORMAT_NAME,
    FORMAT_VERSION as FORMAT_VERSION,
    FORMAT_VERSION_KEY as FORMAT_VERSION_KEY,
    HF_FORMAT_KEY as HF_FORMAT_KEY,
    HF_FORMAT_PT as HF_FORMAT_PT,
    HF_INDEX_FORMAT as HF_INDEX_FORMAT,
    HF_INDEX_NAME as HF_INDEX_NAME,
    HF_SAVE_KEY as HF_SAVE_KEY,
    HF_SHARD_PATTERN as HF_SHARD_PATTERN,
    HF_SINGLE_NAME as HF_SINGLE_NAME,
    HF_TREE_CHECKSUM_KEY as HF_TREE_CHECKSUM_KEY,
    HOST_STATE_KEY as HOST_STATE_KEY,
    LOCAL_UNIT_KEY as LOCAL_UNIT_KEY,
    METADATA_KEY as METADATA_KEY,
    METRICS_KEY as METRICS_KEY,
    OUR_KEY_PREFIX as OUR_KEY_PREFIX,
    PARTS_FORMAT_VERSION as PARTS_FORMAT_VERSION,
    PIECES_KEY as PIECES_KEY,
    PLAIN_FORMAT_VERSION as PLAIN_FORMAT_VERSION,
    PROCESS_KEY as PROCESS_KEY,
    RESERVED_TENSOR_NAMES as RESERVED_TENSOR_NAMES,
    SAVE_KEY as SAVE_KEY,
    STEP_KEY as STEP_KEY,
    TREE_KEY as TREE_KEY,
    USER_METADATA_KEY as USER_METADATA_KEY,
)

SUFFIX = ".safetensors"
SHARDED_SUFFIX = ".shards"
INDEX_NAME = "index.safetensors"
QUARANTINE_MARK = "corrupt-"  # a checkpoint skipped as unreadable: `quarantine_name`
MAX_NAME_BYTES = 200  # file systems allow 255; leave room for the temporary-name decoration


def hf_shard_names(count: int) -> list[str]:
    """The file names of a Hugging Face save in `count` shards."""
    if count == 1:
        return [HF_SINGLE_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


# ------------------------------------------------------------------ a manager's local tier

# `{prefix}{step}.local/process_{i:05d}-of-{n:05d}.safetensors`: process i's unit of a job
# of n processes, in a process's own local directory (its own, or a peer's copy).
LOCAL_SUFFIX = ".local"
_LOCAL_UNIT = re.compile(r"process_(?P<owner>[0-9]{5})-of-(?P<count>[0-9]{5})\.safetensors")


def local_unit_name(owner: int, count: int) -> str:
    return f"process_{owner:05d}-of-{count:05d}.safetensors"


def parse_local_unit(name: str) -> tuple[int, int] | None:
    """`(owner, process count)` of a local unit's file name, or None."""
    match = _LOCAL_UNIT.fullmatch(name)
    return None if match is None else (int(match["owner"]), int(match["count"]))


# ------------------------------------------------------------------------ checkpoint files

# Canonical steps are plain decimals, or Python's shortest float spelling for tiny non-integral
# floats ("1e-05"); earlier versions also wrote str(float) spellings such as "1.0" and "1e+16".
# `[0-9]`, never `\d` (which matches every script's digits, and `int()` reads them).
_STEP = r"[0-9]+(?:\.[0-9]+)?(?:e[-+][0-9]+)?"
# Files written before tokens existed are `process_00000.safetensors`; they still restore.
_PIECE = re.compile(
    rf"process_(?P<process>[0-9]{{5}})(?:\.(?P<token>{_WRITER}-[0-9a-f]{{16}}))?\.safetensors"
)
_DONE = re.compile(rf"\.done-(?P<process>[0-9]{{5}})\.(?P<token>{_WRITER}-[0-9a-f]{{16}})")


Step: TypeAlias = int | float | np.integer | np.floating
"""A checkpoint step: any real number >= 0 (Python or NumPy)."""


def check_prefix(prefix: Any) -> str:
    """`prefix` if it can only ever name files directly inside the checkpoint directory."""
    if not isinstance(prefix, str):
        raise TypeError(f"{call()}: prefix must be a str, got {type(prefix).__name__}.")
    problems = []
    if any(sep and sep in prefix for sep in ("/", "\\", os.sep, os.altsep, "\0")):
        problems.append("it contains a path separator or NUL, so files would land elsewhere")
    if prefix.startswith("."):
        problems.append("it starts with '.', which marks this library's temporary files")
    if prefix.startswith(QUARANTINE_MARK):
        problems.append(
            f"it starts with '{QUARANTINE_MARK}', which marks the checkpoints a manager moved "
            "aside as unreadable"
        )
    if re.search(r"\d[.eE+-]*$", prefix):
        problems.append(
            "it ends with a digit (and maybe '.', 'e', '+', '-'), so the step could not be told "
            "apart from it"
        )
    if len(prefix.encode()) > MAX_NAME_BYTES // 2:
        problems.append(f"it is longer than {MAX_NAME_BYTES // 2} bytes")
    if problems:
        raise ValueError(
            f"{call()}: invalid prefix {prefix!r}: {'; '.join(problems)}. Use a plain file "
            "name prefix such as 'checkpoint_'."
        )
    return prefix


def check_step(step: Any) -> Decimal:
    """The step as an exact Decimal; raises for anything that is not a finite number >= 0."""
    if isinstance(step, bool) or not isinstance(step, int | float | np.integer | np.floating):
        raise TypeError(f"{call()}: step must be an int or float, got {step!r}.")
    if isinstance(step, float | np.floating) and not math.isfinite(step):
        raise ValueError(f"{call()}: step must be finite, got {step!r}.")
    value = _value(step)
    if value < 0:
        raise ValueError(
            f"{call()}: step must be >= 0, got {step!r} (a sign in a file name could not be "
            "told apart from the prefix)."
        )
    return value


def _value(number: Any) -> Decimal:
    """An exact Decimal that orders steps as numbers and is equal for equal values."""
    if isinstance(number, int | np.integer):
        return Decimal(int(number))
    number = float(number)
    # Non-integral floats use their shortest spelling, so 0.1 from a name equals 0.1 passed in.
    return Decimal(int(number)) if number.is_integer() else Decimal(repr(number))


def canonical_step(step: Any) -> str:
    """The one spelling of a step's value: `1`, `1.0`, `-0.0` and `np.int64(1)` are all "1";
    a non-integral float is Python's shortest round-trip spelling ("0.5", "1e-05")."""
    if isinstance(step, int | np.integer):
        return str(int(step))
    value = float(step)
    if value.is_integer():
        return str(int(value))
    return repr(value)


def step_value(text: str) -> Decimal:
    """The numeric value of a step spelling read from a name (exact)."""
    return _value(int(text)) if text.isdigit() else _value(float(text))


def step_from_text(text: str) -> int | float:
    if text.isdigit():
        return int(text)
    value = float(text)
    return int(value) if value.is_integer() else value


def is_canonical(text: str) -> bool:
    return canonical_step(step_from_text(text)) == text


def checkpoint_name(prefix: str, step: Any, *, sharded: bool = False) -> str:
    name = f"{prefix}{canonical_step(step)}{SHARDED_SUFFIX if sharded else SUFFIX}"
    if len(name.encode()) > MAX_NAME_BYTES:
        raise ValueError(
            f"the checkpoint name for step {step!r} would be {len(name.encode())} bytes, more "
            f"than the {MAX_NAME_BYTES} a file name may safely have."
        )
    return name


def checkpoint_pattern(prefix: str) -> re.Pattern[str]:
    """Matches `{prefix}{step}.safetensors` / `.shards` names; groups `step` and `suffix`."""
    suffixes = f"(?P<suffix>{re.escape(SUFFIX)}|{re.escape(SHARDED_SUFFIX)})"
    return re.compile(rf"{re.escape(prefix)}(?P<step>{_STEP}){suffixes}")


def quarantine_name(name: str, attempt: int) -> str:
    """Where `CheckpointManager.restore` moves the checkpoint `name` it skipped as
    unreadable: beside it, under a name no prefix's listing or cleanup matches (it starts
    with the mark), so that it neither blocks nor shadows a new save of its step and is
    never deleted. `attempt` > 0 numbers a later quarantine of the same name."""
    mark = QUARANTINE_MARK if attempt == 0 else f"{QUARANTINE_MARK}{attempt + 1}-"
    return f"{mark}{name}"


def new_token() -> str:
    """A multi-process save's token (chosen by process 0, then shared)."""
    return f"{writer_id()}-{os.urandom(8).hex()}"


def token_writer(token: str) -> tuple[str, int]:
    match = re.fullmatch(_WRITER + r"-[0-9a-f]{16}", token)
    if match is None:
        raise ValueError(f"malformed save token {token!r}")
    return match["host"], int(match["pid"])


def piece_file(process: int, token: str) -> str:
    return f"process_{process:05d}.{token}{SUFFIX}"


def piece_tensor(leaf: str, process: int, k: int) -> str:
    """The name, in its piece file, of the `k`-th piece of `leaf` that `process` writes."""
    return f"{leaf}#{process}.{k}"


def parse_piece_file(name: str) -> tuple[int, str] | None:
    """`(process, token)` of a piece file name ("" for the token of an old untokened name),
    or None: the only names an index may cite."""
    match = _PIECE.fullmatch(name)
    return None if match is None else (int(match["process"]), match["token"] or "")


def done_marker(process: int, token: str) -> str:
    return f".done-{process:05d}.{token}"


def parse_done_marker(name: str) -> tuple[int, str] | None:
    match = _DONE.fullmatch(name)
    return None if match is None else (int(match["process"]), match["token"])


def writer_is_dead(host: str, pid: int) -> bool:
    """True only when the writer ran on this machine and its process is gone; a writer on
    another host is never presumed dead."""
    if host != host_id() or pid == os.getpid() or not 0 < pid < 2**31:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False
