"""Reading tensors in parts is reading them whole (`format._part_reads`).

The laws, for any tensors (sizes from empty to a few parts, any dtype the format stores), any
part size, and files checksummed either way (a digest per part, each verified by the reader
of that part, or one per tensor, as before format version 3): `FileReader.read_many` with
parts returns, bit for bit, what one thread reading each tensor whole returns; and with one
byte of any tensor flipped, it raises the `CheckpointFormatError` that names that tensor. A
planted bug (parts read in the wrong places) makes the first law fail within the default
budget.

And a checksum fed a tensor's bytes in pieces of any length is the checksum of the whole
(`_checksums.Digest`), which a planted bug at part boundaries breaks.
"""

from __future__ import annotations

import contextlib
import tempfile
import zlib
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash
from hypothesis import find, given, strategies as st

from eqx_train.checkpoints import CheckpointFormatError, save_checkpoint
from eqx_train.checkpoints.format import _checksums, _part_reads, _reader
from eqx_train.checkpoints.format._reader import FileReader
from property_tests.expected import DEFAULT_BUDGET

DTYPES = [np.float32, np.int8, np.uint16, np.float64, np.complex64, np.bool_]

# A few tensors of up to 40 KiB each, whose bytes are a function of (index, size).
TENSORS = st.lists(
    st.tuples(st.sampled_from(DTYPES), st.integers(0, 10_000)), min_size=1, max_size=5
)
PARTS = st.integers(1, 9).map(lambda pages: pages * 4096 + 7)  # never a divisor of a tensor


def _tensors(specs: list[tuple[type, int]]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(len(specs))
    tensors = {}
    for i, (dtype, size) in enumerate(specs):
        if dtype is np.bool_:
            tensors[f"t{i}"] = rng.integers(0, 2, size).astype(np.bool_)
        else:  # any bytes, NaN payloads included: compared bit for bit
            raw = rng.integers(0, 256, size * np.dtype(dtype).itemsize, dtype=np.uint8)
            tensors[f"t{i}"] = raw.view(dtype)
    return tensors


@contextlib.contextmanager
def _in_parts(part_bytes: int) -> Iterator[None]:
    """Every read of several tensors on the shared readers, every tensor of more than one
    part read in parts of `part_bytes`."""
    saved = _part_reads.PART_BYTES, _part_reads.SPLIT_BYTES, _reader._PARALLEL_MIN_BYTES
    _part_reads.PART_BYTES, _part_reads.SPLIT_BYTES, _reader._PARALLEL_MIN_BYTES = (
        part_bytes,
        0,
        0,
    )
    try:
        yield
    finally:
        _part_reads.PART_BYTES, _part_reads.SPLIT_BYTES, _reader._PARALLEL_MIN_BYTES = saved


@pytest.fixture(autouse=True, scope="module")
def tiny_parts_accepted() -> Iterator[None]:
    """Files here have parts far smaller than a reader accepts (64 KiB), so that tensors of
    a few KiB have several."""
    saved, _reader._MIN_PART_BYTES = _reader._MIN_PART_BYTES, 4096
    try:
        yield
    finally:
        _reader._MIN_PART_BYTES = saved


def _save(directory: str, tensors: dict[str, np.ndarray], part_bytes: int | None) -> str:
    """The file, its tensors of more than one part checksummed in parts of `part_bytes`, or
    each with one digest where None."""
    saved = _checksums.PART_BYTES
    _checksums.PART_BYTES = 1 << 62 if part_bytes is None else part_bytes
    try:
        return save_checkpoint(directory, tensors, 0)
    finally:
        _checksums.PART_BYTES = saved


def _read(path: str, names: list[str], part_bytes: int) -> dict[str, np.ndarray]:
    with FileReader(path) as reader, _in_parts(part_bytes):
        return reader.read_many(names, parallel=True)


def _whole(path: str, names: list[str]) -> dict[str, np.ndarray]:
    with FileReader(path) as reader:
        return {name: reader.read(name) for name in names}


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes()
        for k in a
    )


# Whether each part has its own digest: the file's parts are then the reads' parts.
PER_PART = st.booleans()


def _law_holds(specs: list[tuple[type, int]], part_bytes: int, per_part: bool = False) -> bool:
    """Read in parts, the tensors are those read whole (a checksum failure breaks the law)."""
    with tempfile.TemporaryDirectory() as directory:
        path = _save(directory, _tensors(specs), part_bytes if per_part else None)
        names = [f"t{i}" for i in range(len(specs))]
        try:
            return _same(_read(path, names, part_bytes), _whole(path, names))
        except CheckpointFormatError:
            return False


@given(TENSORS, PARTS, PER_PART)
def test_reading_in_parts_gives_the_bytes_of_reading_whole(specs, part_bytes, per_part):
    assert _law_holds(specs, part_bytes, per_part)


@given(TENSORS, PARTS, PER_PART, st.data())
def test_a_flipped_byte_anywhere_in_a_tensor_read_in_parts_fails_its_checksum(
    specs, part_bytes, per_part, data
):
    tensors = _tensors(specs)
    sized = [n for n, t in tensors.items() if t.nbytes]
    if not sized:
        return
    name = data.draw(st.sampled_from(sized))
    with tempfile.TemporaryDirectory() as directory:
        path = _save(directory, tensors, part_bytes if per_part else None)
        with FileReader(path) as reader:
            info = reader.tensors[name]
        where = info.start + data.draw(st.integers(0, info.nbytes - 1))
        with open(path, "r+b") as file:
            file.seek(where)
            byte = file.read(1)[0]
            file.seek(where)
            file.write(bytes([byte ^ 0x01]))
        with pytest.raises(CheckpointFormatError, match=f"tensor '{name}' fails its checksum"):
            _read(path, list(tensors), part_bytes)


def test_the_law_catches_parts_read_from_the_wrong_place(monkeypatch):
    split = _part_reads.split

    def swapped(view, offset, part_bytes=None):
        parts = split(view, offset, part_bytes)
        if len(parts) > 2:  # the first two parts (both full) read each other's bytes
            (a, oa), (b, ob) = parts[0], parts[1]
            parts[:2] = [(a, ob), (b, oa)]
        return parts

    monkeypatch.setattr(_part_reads, "split", swapped)
    # `find` raises `NoSuchExample` when no draw within the budget breaks the law.
    specs, part_bytes = find(
        st.tuples(TENSORS, PARTS), lambda drawn: not _law_holds(*drawn), settings=DEFAULT_BUDGET
    )
    assert not _law_holds(specs, part_bytes)


# A tensor's bytes, a part size (or None: one digest), and where to cut the bytes it is fed.
FEEDS = st.tuples(
    st.integers(0, 3000).map(lambda n: np.random.default_rng(n).bytes(n)),
    st.one_of(st.none(), st.integers(1, 700)),
    st.lists(st.integers(0, 3000), max_size=6),
)


def _reference(data: bytes, part_size: int | None) -> _checksums.Checksum:
    """The checksum as docs/checkpoint_format.md defines it, with xxhash alone."""
    salt = f"U8{[len(data)]}"
    if part_size is None:
        return xxhash.xxh3_64_hexdigest(data, seed=zlib.crc32(salt.encode()))
    digests = tuple(
        xxhash.xxh3_64_hexdigest(data[i : i + part_size], seed=zlib.crc32(f"{salt}#{k}".encode()))
        for k, i in enumerate(range(0, max(len(data), 1), part_size))
    )
    return _checksums.Parts(part_size, digests)


def _digest_law_holds(feed: tuple[bytes, int | None, list[int]]) -> bool:
    """Fed whole, or in the pieces the cuts make, a checksum is the documented one."""
    data, part_size, cuts = feed
    digest = _checksums.Digest("U8", [len(data)], part_size)
    bounds = [0, *sorted(min(c, len(data)) for c in cuts), len(data)]
    for start, stop in zip(bounds, bounds[1:], strict=False):
        digest.update(memoryview(data)[start:stop])
    whole = _checksums.checksum("U8", [len(data)], memoryview(data), part_size=part_size)
    return digest.result() == whole == _reference(data, part_size)


@given(FEEDS)
def test_a_checksum_fed_in_pieces_of_any_length_is_the_documented_one(feed):
    assert _digest_law_holds(feed)


def test_the_law_catches_a_part_boundary_in_the_wrong_place(monkeypatch):
    class OffByOne(_checksums.Digest):
        def _next_part(self) -> None:  # each part after the first one byte longer
            super()._next_part()
            assert self.left is not None
            self.left += 1

    monkeypatch.setattr(_checksums, "Digest", OffByOne)
    feed = find(FEEDS, lambda drawn: not _digest_law_holds(drawn), settings=DEFAULT_BUDGET)
    assert not _digest_law_holds(feed)
