"""A span of a tensor's parts: what a restore onto an accelerator reads at once of a tensor
larger than a quarter of its window or of the pinned arena (`FileReader.spans`,
`_part_reads.spans`), and how errors name it."""

from __future__ import annotations

from typing import NamedTuple


class Span(NamedTuple):
    """Parts `first` up to `stop` (not included) of tensor `name`, whose checksum is in
    parts (`_checksums.Parts`), `nbytes` in all, read as one flat array of the tensor's
    dtype: a piece of a tensor that a restore reads and places piece by piece
    (`FileReader.spans`)."""

    name: str
    first: int
    stop: int
    nbytes: int


def name_of(key: str | Span) -> str:
    """The tensor a key of `read_many` (a tensor's name or a `Span` of it) reads from."""
    return key.name if isinstance(key, Span) else key


def describe(key: str | Span) -> str:
    """A key of `read_many` as an error names it."""
    if isinstance(key, Span):
        return f"tensor '{key.name}' (its parts {key.first} to {key.stop - 1})"
    return f"tensor '{key}'"
