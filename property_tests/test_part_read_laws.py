"""Reading tensors in parts is reading them whole (`format._part_reads`).

The laws, for any tensors (sizes from empty to a few parts, any dtype the format stores) and
any part size: `FileReader.read_many` with parts returns, bit for bit, what one thread
reading each tensor whole returns; and with one byte of any tensor flipped, it raises the
`CheckpointFormatError` that names that tensor. A planted bug (parts read in the wrong
places) makes the first law fail within the default budget.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import find, given, strategies as st

from eqx_train.checkpoints import CheckpointFormatError, save_checkpoint
from eqx_train.checkpoints.format import _part_reads, _reader
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


def _law_holds(specs: list[tuple[type, int]], part_bytes: int) -> bool:
    """Read in parts, the tensors are those read whole (a checksum failure breaks the law)."""
    with tempfile.TemporaryDirectory() as directory:
        path = save_checkpoint(directory, _tensors(specs), 0)
        names = [f"t{i}" for i in range(len(specs))]
        try:
            return _same(_read(path, names, part_bytes), _whole(path, names))
        except CheckpointFormatError:
            return False


@given(TENSORS, PARTS)
def test_reading_in_parts_gives_the_bytes_of_reading_whole(specs, part_bytes):
    assert _law_holds(specs, part_bytes)


@given(TENSORS, PARTS, st.data())
def test_a_flipped_byte_anywhere_in_a_tensor_read_in_parts_fails_its_checksum(
    specs, part_bytes, data
):
    tensors = _tensors(specs)
    sized = [n for n, t in tensors.items() if t.nbytes]
    if not sized:
        return
    name = data.draw(st.sampled_from(sized))
    with tempfile.TemporaryDirectory() as directory:
        path = save_checkpoint(directory, tensors, 0)
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
