"""The one file reader of the safetensors bytes (the one writer is `_format`'s).

Layout (see docs/checkpoint_format.md), a plain safetensors file:

    [8 bytes: little-endian u64 N][N bytes: JSON header, space-padded][tensor bytes]

The padding makes the tensor bytes start on a 4 KiB page (64 bytes in files of under 1 MiB
of data), and the writer lays out the tensors whose size is a whole number of pages first,
then those of a whole number of 64 bytes (`file_order`), so that each of them starts on a
page or on 64 bytes; the header lists them in tree order.

The header maps each tensor name (the leaf's key path joined by '.') to its dtype, shape and
byte range, and holds `__metadata__` (string -> string) with our keys (named in `_names`):

- `eqx_train.format` / `eqx_train.format_version`: "eqx_train.checkpoint" / "1" ("2" when the
  file holds a complex tensor, "3" when it holds a tensor checksummed in parts, so that
  older readers refuse it as newer)
- `eqx_train.step`: the step, as JSON
- `eqx_train.tree`: the tree description (JSON, see `_description`), enough to rebuild the
  pytree without a target
- `eqx_train.checksums`: xxh3-64 of every tensor (seeded with its dtype and shape; of each
  8 MiB part of a larger one, in version 3) and of the tree description; absent in files
  written before checksums existed.
- `eqx_train.complex128`: the tensors stored as F64 with a trailing axis of 2 that are
  complex128 (safetensors has no code for it; the bytes are the same); absent when none are.

Everything read from a file is validated before it is trusted or allocated: a malformed file
raises a short `CheckpointFormatError` naming the file and what is wrong. Checksums are
`_checksums`'.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._text import short
from .._errors import NewerFormatError, invalid
from ..storage._base import Source
from ..storage._local_files import LocalSource
from . import _header_codes, _part_reads
from ._arrays import (
    MAX_NDIM as MAX_NDIM,
    Into,
    aligned_empty as aligned_empty,
    buffer_for,
    normalize_index as normalize_index,
    too_big as too_big,
)
from ._checksums import DIGEST_WIDTH, Checksum, Parts, part_count, text_digest, verify_bytes
from ._description import DTYPE_TO_CODE, ReaderBase as ReaderBase, parse_json
from ._header_codes import MAX_HEADER_BYTES, as_bytes
from ._names import (
    CHECKSUM_ALGORITHM,
    CHECKSUMS_KEY,
    FORMAT_VERSION,
    FORMAT_VERSION_KEY,
    METADATA_KEY,
    PLAIN_FORMAT_VERSION,
    TREE_KEY,
)
from ._spans import Span, name_of
from ._timing import stage

_MIN_BYTES_PER_CONTAINER = 8
_PARALLEL_MIN_BYTES = 16 << 20
_FIRST_READ = 16 << 10  # the first request reads the length field and most headers
# The smallest part size a file may give (the writer's is 8 MiB): every part costs a
# reader's task, so a crafted table of tiny parts would slow a restore many times over.
_MIN_PART_BYTES = 64 << 10


# --------------------------------------------------------------------------------------------
# Header: encode when writing, parse and validate when reading.


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute file offset
    nbytes: int
    checksum: Checksum | None = None

    @property
    def code(self) -> str:
        return DTYPE_TO_CODE[self.dtype]


def _is_count(x: Any) -> bool:
    return type(x) is int and x >= 0


def _bytes_of(array: np.ndarray) -> memoryview:
    """The bytes a tensor is read into (none for an empty one)."""
    return as_bytes(array) if array.nbytes else memoryview(b"")


def _is_digest(x: Any) -> bool:
    return isinstance(x, str) and len(x) == DIGEST_WIDTH


def _is_digests(x: Any) -> bool:
    """A checksum table's entry for a tensor: its digest, or a non-empty list of its
    parts' digests."""
    return _is_digest(x) or isinstance(x, list) and bool(x) and all(map(_is_digest, x))


class FileReader(ReaderBase):
    """One open safetensors file: its validated header and reads of its tensors, all through
    one file descriptor (a save that replaces the file meanwhile cannot mix two versions).

    Use as a context manager. Non-regular files (a FIFO, a directory) are refused without
    blocking.
    """

    reads_into = True  # `read_many` reads into the buffers `into` offers

    def __init__(self, path: str, source: Source | None = None):
        self.path = path
        if source is None:
            source = LocalSource(path, invalid(path))
        self.source = source
        try:
            self._parse()
        except BaseException:
            source.close()
            raise

    def check_unchanged(self) -> None:
        """Raises `ObjectReplacedError` (a `FileNotFoundError`) if the file was replaced
        since it was opened, so that what was read may mix two versions (object stores;
        a local file is read through one descriptor and cannot change)."""
        self.source.check_unchanged()

    def close(self) -> None:
        self.source.close()

    def _parse(self) -> None:
        size = self.source.size
        if size < 8:
            raise self.bad(f"the file has {size} bytes, fewer than the 8-byte header length")
        # From an object store, one request for the length field and (usually all of) the
        # header: each request costs a round trip. Locally, exactly the bytes needed.
        first = bytearray(8 if self.source.cheap_reads else min(size, _FIRST_READ))
        self.source.read_into(memoryview(first), 0)
        header_len = int.from_bytes(first[:8], "little")
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise self.bad(
                f"the header claims {header_len} bytes, but the file has {size - 8} after the "
                f"length field and a header may have at most {MAX_HEADER_BYTES}"
            )
        raw = bytearray(header_len)
        have = min(header_len, len(first) - 8)
        raw[:have] = first[8 : 8 + have]
        del first
        if have < header_len:
            self.source.read_into(memoryview(raw)[have:], 8 + have)
        # Parsing costs ~60 bytes of Python objects per JSON object or array; a real header
        # has one per 15+ bytes, a hostile one per 2. Refusing the dense ones bounds memory
        # to a small multiple of the header size.
        containers = raw.count(b"{") + raw.count(b"[")
        if containers > 1024 and containers * _MIN_BYTES_PER_CONTAINER > header_len:
            raise self.bad(
                f"its header has {containers} JSON objects and arrays in {header_len} bytes, "
                "far denser than any checkpoint's"
            )
        entries = parse_json(bytes(raw), "the header", self.bad)
        del raw
        if not isinstance(entries, dict):
            raise self.bad("the header is not a JSON object")
        metadata = entries.pop(METADATA_KEY, {})
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self.bad("__metadata__ must map strings to strings")
        version = metadata.get(FORMAT_VERSION_KEY)
        if version is not None and version not in _header_codes.READABLE_VERSIONS:
            why = (
                f"it has eqx_train format version {short(version)}; this eqx_train reads "
                f"versions {PLAIN_FORMAT_VERSION} to {FORMAT_VERSION}"
            )
            if _header_codes.is_newer(version):
                raise NewerFormatError(
                    f"{self.path} was written by a newer eqx_train: {why}. Upgrade eqx_train "
                    "to read it (a checkpoint manager neither skips nor moves it; if no newer "
                    "eqx_train wrote it, its header is corrupt: move it away by hand)"
                )
            raise self.bad(why)
        checksums = self._checksums(metadata, set(entries))
        wide = _header_codes.complex128_names(metadata, entries, self.bad)
        data_start = 8 + header_len
        data_size = size - data_start
        tensors: dict[str, TensorInfo] = {}
        spans = []
        for name, entry in entries.items():
            if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
                raise self.bad(f"tensor {short(name)} has a malformed entry {short(entry)}")
            code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not isinstance(code, str) or code not in _header_codes.HEADER_CODES:
                raise self.bad(f"tensor {short(name)} has unsupported dtype {short(code)}")
            if (
                not isinstance(shape, list)
                or len(shape) > MAX_NDIM
                or not all(_is_count(s) for s in shape)
                or too_big(shape, _header_codes.HEADER_CODES[code].itemsize)
            ):
                raise self.bad(f"tensor {short(name)} has an invalid shape {short(shape)}")
            if not (
                isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))
            ):
                raise self.bad(f"tensor {short(name)} has invalid data offsets {short(offsets)}")
            begin, end = offsets
            dtype = _header_codes.HEADER_CODES[code]
            nbytes = math.prod(shape) * dtype.itemsize
            if not begin <= end <= data_size or end - begin != nbytes:
                raise self.bad(
                    f"tensor {short(name)} claims bytes [{begin}, {end}) for "
                    f"{code}{short(shape)}, but the data section has {data_size} bytes"
                )
            if name in wide:  # F64 pairs: the same bytes, read as complex128
                dtype, shape = _header_codes.COMPLEX128, shape[:-1]
            checksum = None if checksums is None else self._checksum(checksums, name, nbytes)
            tensors[name] = TensorInfo(
                name, dtype, tuple(shape), data_start + begin, nbytes, checksum
            )
            spans.append((begin, end, name))
        spans.sort()
        for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:], strict=False):
            if b1 < e0:
                raise self.bad(f"tensors {short(n0)} and {short(n1)} overlap")
        self.tensors = tensors
        self.metadata: dict[str, str] = metadata
        self._description: Any = None

    def _checksums(self, metadata: dict[str, str], names: set[str]) -> dict[str, Any] | None:
        raw = metadata.get(CHECKSUMS_KEY)
        if raw is None:
            return None  # written before checksums existed: nothing to verify
        parsed = parse_json(raw, "the checksum table", self.bad)
        ok = (
            isinstance(parsed, dict)
            and parsed.get("algorithm") == CHECKSUM_ALGORITHM
            and isinstance(parsed.get("metadata"), dict)
            and isinstance(parsed.get("tensors"), dict)
            and all(map(_is_digests, parsed["tensors"].values()))
        )
        if not ok:
            raise self.bad("its checksum table is malformed")
        table: dict[str, Any] = parsed["tensors"]
        size = parsed.get("part_bytes")
        # Of at least `_MIN_PART_BYTES`: a crafted size must not cut a read into tiny parts.
        if (size is not None or any(isinstance(v, list) for v in table.values())) and not (
            type(size) is int and size >= _MIN_PART_BYTES
        ):
            raise self.bad(f"its checksum table has an invalid part size {short(size)}")
        if set(table) != names:
            odd = sorted(set(table) ^ names)[:5]
            raise self.bad(f"its checksum table and its tensors disagree on the names {short(odd)}")
        sealed: dict[str, Any] = parsed["metadata"]
        for key in set(metadata) - {CHECKSUMS_KEY} | set(sealed):
            value = metadata.get(key)
            if value is None or sealed.get(key) != text_digest(value):
                what = "tree description" if key == TREE_KEY else f"metadata {short(key)}"
                raise self.bad(f"its {what} fails its checksum")
        self._part_bytes: int = size or 0
        return table

    def _checksum(self, table: dict[str, Any], name: str, nbytes: int) -> Checksum:
        """Tensor `name`'s checksum, from the validated `table`: a list of digests must
        have one per part of the table's `part_bytes`."""
        digests = table[name]
        if isinstance(digests, str):
            return digests
        expected = part_count(nbytes, self._part_bytes)
        if len(digests) != expected:
            raise self.bad(
                f"its checksum table lists {len(digests)} parts for tensor {short(name)}, "
                f"whose {nbytes} bytes make {expected} of {self._part_bytes}"
            )
        return Parts(self._part_bytes, tuple(digests))

    # ------------------------------------------------------------------ contents

    def arrays(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {name: (info.shape, info.dtype) for name, info in self.tensors.items()}

    def files(self) -> dict[str, FileReader]:
        """This file, by its path (the layouts of several files list each)."""
        return {self.path: self}

    def read(
        self, name: str, index: tuple[slice, ...] | None = None, *, verify: bool = True
    ) -> np.ndarray:
        """Tensor `name`, or its block `index` (a tuple of slices with explicit bounds).

        A whole tensor is read into its final buffer and verified against its checksum.
        Without verification, a block reads only the rows (axis 0) that overlap it.
        """
        info = self.tensors[name]
        index = None if index is None else normalize_index(index, info.shape)
        whole = index is None or all(
            (s.start, s.stop) == (0, d) for s, d in zip(index, info.shape, strict=True)
        )
        if whole or verify or not info.shape:
            out = aligned_empty(info.shape, info.dtype)
            self._fill(info, out, verify)
            return out if whole else out[index].copy()
        assert index is not None
        first, stop = index[0].start, index[0].stop
        row_bytes = math.prod(info.shape[1:]) * info.dtype.itemsize
        rows = aligned_empty((stop - first, *info.shape[1:]), info.dtype)
        if rows.nbytes:
            self.source.read_into(as_bytes(rows), info.start + first * row_bytes)
        return rows[(slice(None), *index[1:])].copy() if len(index) > 1 else rows

    def _fill(self, info: TensorInfo, out: np.ndarray, verify: bool) -> None:
        """Reads tensor `info` into `out` (and checks it). Locally chunk by chunk, each
        hashed while still in cache; from an object store in parallel ranged requests."""
        view = _bytes_of(out)
        check = verify and info.checksum
        if not self.source.cheap_reads or not check:
            with stage("read"):
                self.source.read_ranges([(view, info.start)])
            if check:
                with stage("verify"):
                    verify_bytes(info, view, self.bad)
            return
        _part_reads.read_while_hashing(
            self.source.read_into,
            info.start,
            lambda each: verify_bytes(info, view, self.bad, each),
        )

    def spans(self, name: str, max_bytes: int) -> list[Span] | None:
        """Tensor `name` as spans of its parts for `read_many` (`_part_reads.spans`): a
        restore onto an accelerator reads and places a tensor larger than a quarter of its
        window (or of the pinned arena) span by span."""
        return _part_reads.spans(self.tensors[name], max_bytes)

    def _key_info(self, key: str | Span) -> tuple[TensorInfo, tuple[int, ...], int | None]:
        """The tensor a key of `read_many` reads from, the shape it is read as, and the
        index of its first part (None: the whole tensor)."""
        info = self.tensors[name_of(key)]
        if not isinstance(key, Span):
            return info, info.shape, None
        try:
            return info, _part_reads.span_shape(info, key), key.first
        except ValueError as error:
            raise ValueError(f"{error} in {self.path}") from None

    def read_many(
        self,
        names: Sequence[str | Span],
        *,
        verify: bool = True,
        parallel: bool = True,
        into: Into | None = None,
    ) -> dict[Any, np.ndarray]:
        """Whole tensors, by name, or spans of them (`spans`), by span: read (and verified)
        by several threads when they are large (`_part_reads`). `into(key, shape, dtype)`,
        if given, offers the buffer a tensor is read into (a pinned host buffer, see
        `pipeline._pinned`); where it gives None, the tensor gets a buffer of its own."""
        keyed = [self._key_info(key) for key in names]
        outs = [
            buffer_for(key, shape, info.dtype, into)
            for key, (info, shape, _) in zip(names, keyed, strict=True)
        ]
        views = [_bytes_of(out) for out in outs]
        jobs = [
            (info, out, view, first)
            for (info, _, first), out, view in zip(keyed, outs, views, strict=True)
        ]
        if not self.source.cheap_reads:
            # An object store: every range at once, so requests overlap.
            self.source.read_ranges(
                [
                    (view, _part_reads.span_offset(info, first))
                    for info, _, view, first in jobs
                    if len(view)
                ]
            )
            if verify:
                checks = [(i, v, f) for i, _, v, f in jobs]
                _part_reads.verify_tensors(checks, self.bad, parallel=parallel)
        elif parallel and sum(len(view) for view in views) >= _PARALLEL_MIN_BYTES:
            cached = getattr(self.source, "cached", None)
            _part_reads.read_tensors(
                self._fill, self.source.read_into, jobs, verify, self.bad, cached
            )
        else:
            for info, out, view, first in jobs:
                if first is None:
                    self._fill(info, out, verify)
                    continue
                with stage("read"):
                    self.source.read_into(view, _part_reads.span_offset(info, first))
                if verify:
                    _part_reads.verify_tensors([(info, view, first)], self.bad, parallel=False)
        return dict(zip(names, outs, strict=True))

    def verify_read(self, arrays: dict[Any, np.ndarray]) -> None:
        """Checks tensors (or spans) `read_many(verify=False)` returned (by key) against their
        checksums, on the shared readers (`_part_reads.verify_tensors`): a restore onto an
        accelerator checks a group while its transfers run, and raises before it returns."""
        jobs = []
        for key, array in arrays.items():
            info, _, first = self._key_info(key)
            jobs.append((info, _bytes_of(array), first))
        _part_reads.verify_tensors(jobs, self.bad)
