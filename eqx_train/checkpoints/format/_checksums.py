"""Checksums of tensor bytes and metadata values: xxh3-64, computed chunk by chunk so that
bytes are hashed while they are still in the CPU cache right after a read or before a write.
Every checksum, written or read, goes through `hasher`; every comparison through
`verify_bytes` or `verify_parts`."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import xxhash

_HASH_CHUNK = 2 << 20


@runtime_checkable
class TensorBytes(Protocol):
    """What `verify_bytes` needs to know of a tensor (a `_reader.TensorInfo`)."""

    @property
    def name(self) -> str: ...

    @property
    def code(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def checksum(self) -> str | None: ...


def hasher(code: str, shape: Sequence[int]) -> Any:
    """The checksum of one tensor, fed in chunks: xxh3-64 of its bytes, seeded by its dtype
    and shape so that a header edit of either is caught too."""
    return xxhash.xxh3_64(seed=zlib.crc32(f"{code}{list(shape)}".encode()))


def chunks(view: memoryview, size: int = _HASH_CHUNK) -> list[memoryview]:
    # Bytes are hashed chunk by chunk right after they are read or before they are written,
    # while they are still in the CPU cache: the checksum then costs little memory bandwidth.
    return [view[i : i + size] for i in range(0, len(view), size)]


def checksum(
    code: str,
    shape: Sequence[int],
    view: memoryview,
    each: Callable[[memoryview], Any] | None = None,
) -> str:
    """The checksum (hex) of a tensor's bytes `view`, hashed chunk by chunk; `each(chunk)`,
    if given, runs on each chunk just before it is hashed (the read that fills it, or the
    write that sends it)."""
    check = hasher(code, shape)
    for chunk in chunks(view):
        if each is not None:
            each(chunk)
        check.update(chunk)
    return check.hexdigest()


def verify_bytes(
    info: TensorBytes,
    view: memoryview,
    bad: Callable[[str], Exception],
    each: Callable[[memoryview], Any] | None = None,
) -> None:
    """Raises `bad(...)` unless the bytes `view` of tensor `info` match its recorded checksum
    (`each` as in `checksum`)."""
    if checksum(info.code, info.shape, view, each) != info.checksum:
        raise bad(_corrupt(info))


def verify_parts(
    info: TensorBytes, parts: Iterable[memoryview], bad: Callable[[str], Exception]
) -> None:
    """As `verify_bytes`, for a tensor whose bytes arrive as consecutive `parts` (an iterator
    that may wait for each one to be read): each part is hashed as soon as it is yielded."""
    check = hasher(info.code, info.shape)
    for part in parts:
        for chunk in chunks(part):
            check.update(chunk)
    if check.hexdigest() != info.checksum:
        raise bad(_corrupt(info))


def _corrupt(info: TensorBytes) -> str:
    return f"tensor '{info.name}' fails its checksum (the data is corrupt)"


def text_digest(text: str) -> str:
    """The checksum (hex) of a metadata value."""
    # surrogatepass: a crafted header may hold lone surrogates, which must hash, not crash.
    return xxhash.xxh3_64_hexdigest(text.encode("utf-8", "surrogatepass"))
