"""How a checkpoint header spells what is not a tensor's bytes: the format version (which
versions this eqx_train reads, and which it must refuse as newer) and each tensor's dtype
code, complex128 included, which safetensors has no code for.

complex128 is stored as `F64` with a trailing axis of 2 (real, imaginary: the same bytes),
listed by name under `eqx_train.complex128`. A file or `.shards` index holding any complex
tensor is written as format version 2 (or 3, `_keys`), so that readers of version 1 refuse
it as newer instead of returning float64 pairs or moving it aside as corrupt.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ..._text import short
from .._errors import CheckpointFormatError
from ._json import parse_json
from ._keys import (
    ALIGN_FOR_DEVICE as ALIGN_FOR_DEVICE,
    COMPLEX128_KEY,
    COMPLEX_FORMAT_VERSION,
    FORMAT_VERSION,
    FORMAT_VERSION_KEY,
    PLAIN_FORMAT_VERSION,
)
from ._leaf_kinds import CODE_TO_DTYPE, DTYPE_TO_CODE, Tensor

# A header this big already describes ~100k tensors; parsing JSON costs ~10-30x its size in
# Python objects, so the cap is what bounds a hostile file's memory.
MAX_HEADER_BYTES = 32 * 1024 * 1024


def as_bytes(array: np.ndarray) -> memoryview:
    """The bytes of `array` as they are written and read: C order, no copy when it is
    contiguous already."""
    flat = np.ascontiguousarray(array).reshape(-1)
    return flat.view(np.uint8).data


READABLE_VERSIONS = frozenset(map(str, range(PLAIN_FORMAT_VERSION, FORMAT_VERSION + 1)))
COMPLEX128 = np.dtype(np.complex128)
# What a header may name: every dtype of the table but complex128, which it stores as F64.
HEADER_CODES = {code: d for code, d in CODE_TO_DTYPE.items() if d != COMPLEX128}


def is_newer(version: str) -> bool:
    """Whether `version` spells, in ASCII digits, a number above `FORMAT_VERSION`: compared by
    length past the leading zeros first, since `int()` refuses more than 4300 digits.
    ASCII only: `isdigit()` also accepts "²" (which `int()` refuses) and every script's
    digits ("١"), none of which a writer of this format spells."""
    if not (version.isascii() and version.isdigit()):
        return False
    digits = version.lstrip("0")
    return len(digits) > len(str(FORMAT_VERSION)) or int(digits or "0") > FORMAT_VERSION


def header_dtype(tensor: Tensor) -> tuple[str, list[int]]:
    """A tensor's dtype code and shape as its header entry says them: a complex128 tensor
    as F64 with a trailing axis of 2 (real, imaginary), which has the same bytes and which
    any safetensors reader reads."""
    if tensor.dtype == COMPLEX128:
        return "F64", [*tensor.shape, 2]
    return DTYPE_TO_CODE[tensor.dtype], list(tensor.shape)


def with_complex(metadata: dict[str, str], dtypes: Iterable[np.dtype]) -> dict[str, str]:
    """`metadata` for a file or `.shards` index of tensors of `dtypes`: unchanged, or, when
    one is complex, as format version 2 (at least), which readers of version 1 (every
    release before complex numbers) refuse as newer: neither taken as float64 pairs nor,
    by a checkpoint manager, moved aside as corrupt for an unknown dtype code."""
    if not any(np.dtype(d).kind == "c" for d in dtypes):
        return metadata
    return at_least(metadata, COMPLEX_FORMAT_VERSION)


def at_least(metadata: dict[str, str], version: int) -> dict[str, str]:
    """`metadata` written as format `version`, or as its own version where that is higher."""
    current = int(metadata.get(FORMAT_VERSION_KEY, str(PLAIN_FORMAT_VERSION)))
    return {**metadata, FORMAT_VERSION_KEY: str(max(current, version))}


def with_complex128(metadata: dict[str, str], tensors: Sequence[Tensor]) -> dict[str, str]:
    """`metadata` for a file of `tensors`, as `with_complex` makes it, listing the tensors
    that are complex128 where there are some."""
    metadata = with_complex(metadata, [t.dtype for t in tensors])
    wide = [t.name for t in tensors if t.dtype == COMPLEX128]
    if not wide:
        return metadata
    return {**metadata, COMPLEX128_KEY: json.dumps(wide, ensure_ascii=False)}


def complex128_names(
    metadata: dict[str, str],
    entries: dict[str, Any],
    bad: Callable[[str], CheckpointFormatError],
) -> set[str]:
    """The tensors a header stores as F64 pairs that are complex128 (validated: each names
    an F64 tensor whose last axis is 2); `bad` makes the error for a malformed list."""
    raw = metadata.get(COMPLEX128_KEY)
    if raw is None:
        return set()
    names = parse_json(raw, "the list of complex128 tensors", bad)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise bad(f"its list of complex128 tensors is malformed: {short(raw)}")
    if len(set(names)) != len(names):
        raise bad("its list of complex128 tensors names a tensor twice")
    for name in names:
        entry = entries.get(name)
        if not (
            isinstance(entry, dict)
            and entry.get("dtype") == "F64"
            and isinstance(entry.get("shape"), list)
            and entry["shape"][-1:] == [2]
        ):
            raise bad(
                f"its list of complex128 tensors names {short(name)}, which is not a "
                "float64 tensor with a last axis of 2"
            )
    return set(names)
