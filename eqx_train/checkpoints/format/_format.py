"""The safetensors bytes: the one writer (the header encoded, the tensors laid out and
written, their checksums computed as they go), and the one file reader (`_reader`'s, with
the layout, re-exported here).

The writer knows nothing of devices: each leaf's host bytes come from the source that
`leaves_from` sets (the save pipeline's transfers, `pipeline._transfer.through_window`),
or are read as each is written outside a save.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import closing
from typing import Any

import numpy as np

from ... import _progress
from ..._calls import call
from ..storage._local_files import start_writeback
from . import _header_codes
from ._checksums import (
    Checksum,
    Digest,
    Parts,
    checksum,
    chunks,
    placeholder,
    text_digest,
    written_part_size,
)
from ._header_codes import (
    ALIGN_FOR_DEVICE,
    MAX_HEADER_BYTES as MAX_HEADER_BYTES,
    as_bytes,
)
from ._leaf_kinds import DTYPE_TO_CODE, Tensor
from ._names import (
    CHECKSUM_ALGORITHM,
    CHECKSUMS_KEY,
    FORMAT_KEY,
    FORMAT_NAME,
    FORMAT_VERSION_KEY,
    METADATA_KEY,
    PARTS_FORMAT_VERSION,
    PLAIN_FORMAT_VERSION,
    STEP_KEY,
    TREE_KEY,
)
from ._timing import stage, timing

# The data section starts on a page once there is this much data: copies between the page
# cache and 64-byte-aligned buffers then run at memcpy speed (tensors starting 40 bytes past
# a 64-byte boundary read 10-30% slower here). Smaller files start on 64 bytes.
_PAGE = 4096
_PAGE_ALIGNED_FROM = 1 << 20
_WRITE_CHUNK = 1 << 30  # Linux writes at most ~2 GiB per call; stay well below.
_STREAM_CHUNK = 16 << 20  # bytes per write to an upload stream
_WRITE_BLOCK = 16 << 20  # bytes per write to a file: a crash test can stop between them


def base_metadata(step_text: str, description: Any) -> dict[str, str]:
    """The `__metadata__` entries every eqx_train checkpoint (file or index) carries."""
    return {
        FORMAT_KEY: FORMAT_NAME,
        FORMAT_VERSION_KEY: str(PLAIN_FORMAT_VERSION),
        STEP_KEY: step_text,
        TREE_KEY: json.dumps(description, separators=(",", ":")),
    }


def _encode_header(
    tensors: Sequence[Tensor], metadata: dict[str, str], digests: Mapping[str, Checksum]
) -> bytes:
    """The header: `tensors` listed in tree order, their bytes laid out in `file_order`."""
    metadata = _header_codes.with_complex128(metadata, tensors)  # sealed below like the rest
    sizes = {d.size for d in digests.values() if isinstance(d, Parts)}
    if sizes:
        metadata = _header_codes.at_least(metadata, PARTS_FORMAT_VERSION)
    checksums: dict[str, Any] = {
        "algorithm": CHECKSUM_ALGORITHM,
        "metadata": {key: text_digest(value) for key, value in metadata.items()},
        "tensors": {t.name: _json_checksum(digests[t.name]) for t in tensors},
    }
    if sizes:
        (checksums["part_bytes"],) = sizes  # one part size per file
    entries: dict[str, Any] = {
        METADATA_KEY: {**metadata, CHECKSUMS_KEY: json.dumps(checksums, separators=(",", ":"))}
    }
    offsets, offset = {}, 0
    for t in file_order(tensors):
        offsets[t.name] = [offset, offset + t.nbytes]
        offset += t.nbytes
    for t in tensors:
        code, shape = _header_codes.header_dtype(t)
        entries[t.name] = {"dtype": code, "shape": shape, "data_offsets": offsets[t.name]}
    raw = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    alignment = _PAGE if offset >= _PAGE_ALIGNED_FROM else ALIGN_FOR_DEVICE
    raw += b" " * (-(8 + len(raw)) % alignment)
    if len(raw) > MAX_HEADER_BYTES:
        raise ValueError(
            f"the checkpoint header would be {len(raw)} bytes, more than the "
            f"{MAX_HEADER_BYTES} a reader accepts; save fewer, larger leaves."
        )
    return len(raw).to_bytes(8, "little") + raw


def file_order(tensors: Sequence[Tensor]) -> list[Tensor]:
    """The order of the tensors' bytes in a file: those whose size is a whole number of pages
    first, then of 64 bytes, then the rest, each in tree order. The data section starts on a
    page (on 64 bytes under 1 MiB of data: `_encode_header`), so a 4-byte `step` or Adam's
    `count` no longer leaves every tensor after it misaligned: each tensor of a whole number
    of pages starts on a page, each of a whole number of 64 bytes on 64 bytes; only the
    rest may start anywhere."""

    def rank(tensor: Tensor) -> int:
        return (
            0 if tensor.nbytes % _PAGE == 0 else 1 if tensor.nbytes % ALIGN_FOR_DEVICE == 0 else 2
        )

    return sorted(tensors, key=rank)  # stable


def _json_checksum(digest: Checksum) -> str | list[str]:
    return digest if isinstance(digest, str) else list(digest.digests)


def _no_digests(tensors: Sequence[Tensor]) -> dict[str, Checksum]:
    """Placeholders as wide as the real digests: the header keeps its length."""
    return {t.name: placeholder(t.nbytes) for t in tensors}


def tensor_checksum(tensor: Tensor, view: memoryview) -> Checksum:
    """The checksum written for `tensor`, whose bytes are `view`."""
    return checksum(
        DTYPE_TO_CODE[tensor.dtype], tensor.shape, view, part_size=written_part_size(tensor.nbytes)
    )


def check_header_size(tensors: Sequence[Tensor], metadata: dict[str, str]) -> None:
    """Raises, naming the public call in progress, before anything is written if the file's
    header would be too big to read."""
    try:
        _encode_header(tensors, metadata, _no_digests(tensors))
    except ValueError as error:
        raise ValueError(f"{call()}: {error}") from None


def write_all(fd: int, data: memoryview) -> None:
    """Writes every byte of `data` to `fd` (os.write may write fewer bytes than asked)."""
    view = data
    while len(view):
        written = os.write(fd, view[:_WRITE_CHUNK])
        view = view[written:]


# Where the writer's leaf values come from: given the tensors and whether this is the last
# pass over them (a stream is passed over twice), each tensor with its value as a host NumPy
# array, in order, each valid until the next is asked for.
LeafSource = Callable[[Sequence[Tensor], bool], Generator[tuple[Tensor, np.ndarray], None, None]]


def _plain_leaves(
    tensors: Sequence[Tensor], final: bool
) -> Generator[tuple[Tensor, np.ndarray], None, None]:
    """Each leaf's value read as it is written: what the writer does outside a save."""
    for tensor in tensors:
        yield tensor, np.asarray(tensor.get())


_leaf_source: contextvars.ContextVar[LeafSource] = contextvars.ContextVar(
    "eqx_train_leaf_source", default=_plain_leaves
)


@contextlib.contextmanager
def leaves_from(source: LeafSource) -> Iterator[None]:
    """Within this block (in this thread), the writer takes its leaves from `source`: the
    save pipeline sets its device transfers here, so that the writer keeps its
    three-argument call and the byte format knows nothing of devices."""
    token = _leaf_source.set(source)
    try:
        yield
    finally:
        _leaf_source.reset(token)


def write_file(out: Any, tensors: Sequence[Tensor], metadata: dict[str, str]) -> None:
    """The one writer, to a file descriptor (`out: int`) or a binary stream (an upload).

    Leaves reach the host from the source `leaves_from` set (the save pipeline's: the
    transfers of the next leaves run while the current one is hashed and written, and at
    most the save's `host_window_bytes` of leaf bytes are held on the host).

    To a file descriptor: the header, then each tensor's bytes hashed and written in turn,
    then the header again with the real checksums (digests have a fixed width, so it has
    exactly the first one's length). A stream cannot be rewritten, so there the leaves go
    through the pipeline twice: once to hash them for the header, once to write them
    (hashed again: a leaf that changed in between is refused rather than written under a
    wrong checksum); neither pass frees the snapshot, since the upload may be retried.
    """
    source = _leaf_source.get()
    _progress.expect(sum(t.nbytes for t in tensors))
    if isinstance(out, int):
        _write_to_fd(out, tensors, metadata, source)
        return
    ordered, digests = file_order(tensors), {}
    with closing(source(ordered, False)) as leaves:
        for t, array in leaves:
            digests[t.name] = tensor_checksum(t, as_bytes(array))
    out.write(_encode_header(tensors, metadata, digests))
    # Not the final pass either: an upload may be tried again (a store that refuses
    # conditional writes), so the snapshot is let go by the save once it is over.
    with closing(source(ordered, False)) as leaves:
        for t, array in leaves:
            check = Digest(DTYPE_TO_CODE[t.dtype], t.shape, written_part_size(t.nbytes))
            for block in chunks(as_bytes(array), _STREAM_CHUNK):
                check.update(block)
                out.write(block)
            if check.result() != digests[t.name]:
                raise RuntimeError(f"{call()}: leaf '{t.name}' changed while it was being saved.")
            _progress.advance(t.nbytes)


def _write_to_fd(
    fd: int, tensors: Sequence[Tensor], metadata: dict[str, str], source: LeafSource
) -> None:
    """The file in stages that run at once: the transfers of the next leaves (started by
    the leaf `source` within its window), the hash of the current leaf (in its own thread) and
    its write (in this thread, in order, so the file only ever grows: a crash leaves a
    prefix). A save then takes as long as its slowest stage, the disk's, plus the first
    transfer and the header."""
    placeholder = _encode_header(tensors, metadata, _no_digests(tensors))
    write_all(fd, memoryview(placeholder))
    offset = len(placeholder)  # of the next block; the disk starts on each one written
    digests = {}
    with (
        ThreadPoolExecutor(1, thread_name_prefix="eqx_train-hash") as hashing,
        closing(source(file_order(tensors), True)) as leaves,
    ):
        for t, array in leaves:
            view = as_bytes(array)
            digest = hashing.submit(_timed_checksum, t, view)
            try:
                with stage("write"):
                    for block in chunks(view, _WRITE_BLOCK):
                        write_all(fd, block)
                        start_writeback(fd, offset, len(block))
                        offset += len(block)
            finally:
                # The leaf's bytes are released by the next step of `leaves`: not before
                # its hash is done with them, even when the write failed.
                wait([digest])
            digests[t.name] = digest.result()
            _progress.advance(t.nbytes)
    header = _encode_header(tensors, metadata, digests)
    if len(header) != len(placeholder):  # pragma: no cover - digests are fixed-width hex
        raise AssertionError("checkpoint header changed length")
    view, done = memoryview(header), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], done)
    if timing():  # for the stage breakdown; the storage's own fsync then finds nothing to do
        with stage("fsync"):
            os.fsync(fd)


def _timed_checksum(tensor: Tensor, view: memoryview) -> Checksum:
    with stage("hash"):
        return tensor_checksum(tensor, view)
