"""Checksums of tensor bytes and metadata values: xxh3-64, computed chunk by chunk so that
bytes are hashed while they are still in the CPU cache right after a read or before a write.

A tensor of at most `PART_BYTES` has one digest; a larger one (format version 3) one per
part of `PART_BYTES` (the last one shorter), each seeded with the part's index as well, so
that several threads verify one tensor at once, each the part it just read, and a part
moved elsewhere in the tensor is caught. One xxh3 stream runs at one core's speed (about
7 GiB/s): a tensor of one digest costs a restore that long however many threads read it.
Files written before parts (one digest per tensor, however large) verify as they always did.

Every checksum, written or read, goes through `Digest`; every comparison through
`verify_bytes`, `verify_parts` or `verify_part`.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import xxhash

_HASH_CHUNK = 2 << 20
# The bytes of each part of a large tensor that has a digest of its own. A part is what one
# reading thread reads and verifies while it is still in cache (a restore reads about 8
# parts at once); small enough for a 64 MiB leaf to keep 8 readers busy, large enough that
# a 1 TiB checkpoint's header lists some 100k digests.
PART_BYTES = 8 << 20
DIGEST_WIDTH = 16  # hex digits of an xxh3-64 digest


class Parts(NamedTuple):
    """A large tensor's checksum: the digest of each consecutive `size` bytes of it."""

    size: int
    digests: tuple[str, ...]


Checksum = str | Parts


@runtime_checkable
class TensorBytes(Protocol):
    """What the verifiers need to know of a tensor (a `_reader.TensorInfo`)."""

    @property
    def name(self) -> str: ...

    @property
    def code(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def checksum(self) -> Checksum | None: ...


def part_count(nbytes: int, size: int) -> int:
    """How many parts of `size` bytes (the last one shorter) cover `nbytes`."""
    return max(1, -(-nbytes // size))


def written_part_size(nbytes: int) -> int | None:
    """The part size a tensor of `nbytes` is written with: None (one digest) for a tensor of
    at most one part."""
    return PART_BYTES if nbytes > PART_BYTES else None


def _hasher(code: str, shape: Sequence[int], part: int | None) -> Any:
    # Seeded by dtype and shape so that a header edit of either is caught too; a part also
    # by its index, so that two parts swapped are caught.
    salt = f"{code}{list(shape)}" if part is None else f"{code}{list(shape)}#{part}"
    return xxhash.xxh3_64(seed=zlib.crc32(salt.encode()))


def chunks(view: memoryview, size: int = _HASH_CHUNK) -> list[memoryview]:
    # Bytes are hashed chunk by chunk right after they are read or before they are written,
    # while they are still in the CPU cache: the checksum then costs little memory bandwidth.
    return [view[i : i + size] for i in range(0, len(view), size)]


class Digest:
    """The checksum of one tensor (dtype `code`, `shape`), fed its bytes in order in pieces
    of any length: one digest where `part_size` is None, else one per `part_size` bytes."""

    def __init__(self, code: str, shape: Sequence[int], part_size: int | None):
        self.code, self.shape, self.part_size = code, tuple(shape), part_size
        self.done: list[str] = []
        self.left = part_size  # bytes of the current part still to come
        self.check = _hasher(code, shape, None if part_size is None else 0)

    def update(self, view: memoryview) -> None:
        """Hashes the next bytes of the tensor."""
        while len(view):
            if self.left == 0:
                self._next_part()
            take = len(view) if self.left is None else min(len(view), self.left)
            for chunk in chunks(view[:take]):
                self.check.update(chunk)
            view = view[take:]
            if self.left is not None:
                self.left -= take

    def _next_part(self) -> None:
        assert self.part_size is not None
        self.done.append(self.check.hexdigest())
        self.check = _hasher(self.code, self.shape, len(self.done))
        self.left = self.part_size

    def result(self) -> Checksum:
        """The checksum of the bytes fed so far."""
        if self.part_size is None:
            return self.check.hexdigest()
        return Parts(self.part_size, (*self.done, self.check.hexdigest()))


def part_digest(
    code: str,
    shape: Sequence[int],
    index: int,
    view: memoryview,
    each: Callable[[memoryview], Any] | None = None,
) -> str:
    """The digest of part `index` of a tensor, whose bytes are `view` (`each` as in
    `checksum`)."""
    check = _hasher(code, shape, index)
    _feed(check.update, view, each)
    return check.hexdigest()


def checksum(
    code: str,
    shape: Sequence[int],
    view: memoryview,
    each: Callable[[memoryview], Any] | None = None,
    part_size: int | None = None,
) -> Checksum:
    """The checksum of a tensor's bytes `view` (in parts of `part_size`, where given),
    hashed chunk by chunk; `each(chunk)`, if given, runs on each chunk just before it is
    hashed (the read that fills it, or the write that sends it)."""
    digest = Digest(code, shape, part_size)
    _feed(digest.update, view, each)
    return digest.result()


def _feed(
    update: Callable[[memoryview], Any],
    view: memoryview,
    each: Callable[[memoryview], Any] | None,
) -> None:
    for chunk in chunks(view):
        if each is not None:
            each(chunk)
        update(chunk)


def _part_size(info: TensorBytes) -> int | None:
    return info.checksum.size if isinstance(info.checksum, Parts) else None


def verify_bytes(
    info: TensorBytes,
    view: memoryview,
    bad: Callable[[str], Exception],
    each: Callable[[memoryview], Any] | None = None,
) -> None:
    """Raises `bad(...)` unless the bytes `view` of tensor `info` match its recorded checksum
    (`each` as in `checksum`)."""
    _compare(info, checksum(info.code, info.shape, view, each, _part_size(info)), bad)


def verify_parts(
    info: TensorBytes, parts: Iterable[memoryview], bad: Callable[[str], Exception]
) -> None:
    """As `verify_bytes`, for a tensor whose bytes arrive as consecutive `parts` (an iterator
    that may wait for each one to be read): each part is hashed as soon as it is yielded."""
    digest = Digest(info.code, info.shape, _part_size(info))
    for part in parts:
        digest.update(part)
    _compare(info, digest.result(), bad)


def _compare(info: TensorBytes, found: Checksum, bad: Callable[[str], Exception]) -> None:
    """Raises `bad(...)` unless `found` is `info`'s checksum, naming the first part that
    differs where it has parts."""
    if found == info.checksum:
        return
    if isinstance(found, Parts) and isinstance(info.checksum, Parts):
        pairs = zip(found.digests, info.checksum.digests, strict=True)
        index = next(i for i, (a, b) in enumerate(pairs) if a != b)
        raise bad(_corrupt(info, _part(info, index, found.size)))
    raise bad(_corrupt(info))


def verify_part(
    info: TensorBytes,
    index: int,
    view: memoryview,
    bad: Callable[[str], Exception],
    each: Callable[[memoryview], Any] | None = None,
) -> None:
    """Raises `bad(...)` unless `view`, part `index` of tensor `info` (whose checksum is
    `Parts`), matches that part's digest (`each` as in `checksum`)."""
    assert isinstance(info.checksum, Parts)
    if part_digest(info.code, info.shape, index, view, each) != info.checksum.digests[index]:
        raise bad(_corrupt(info, _part(info, index, info.checksum.size)))


def _part(info: TensorBytes, index: int, size: int) -> str:
    start, stop = index * size, min((index + 1) * size, info.nbytes)
    return f" in its part {index} (its bytes {start} to {stop})"


def _corrupt(info: TensorBytes, where: str = "") -> str:
    return f"tensor '{info.name}' fails its checksum{where} (the data is corrupt)"


def placeholder(nbytes: int) -> Checksum:
    """A checksum as wide in a header as the real one of a tensor of `nbytes`: zeros."""
    size = written_part_size(nbytes)
    zero = "0" * DIGEST_WIDTH
    return zero if size is None else Parts(size, (zero,) * part_count(nbytes, size))


def text_digest(text: str) -> str:
    """The checksum (hex) of a metadata value."""
    # surrogatepass: a crafted header may hold lone surrogates, which must hash, not crash.
    return xxhash.xxh3_64_hexdigest(text.encode("utf-8", "surrogatepass"))
