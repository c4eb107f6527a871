"""Reading flax.training msgpack checkpoints without flax.

A flax checkpoint file is one msgpack object: flax's state dict of the saved tree (lists and
tuples already turned into dicts keyed '0', '1', ...), with three extension types:

- code 1, an ndarray: a msgpack array `[shape, dtype name, raw C-order bytes]`;
- code 2, a native Python complex: a msgpack array `[real, imag]`;
- code 3, a NumPy scalar: encoded as a 0-d ndarray.

Arrays larger than flax's chunk size (1 GiB) are saved as a dict
`{"__msgpack_chunked_array__": True, "shape": {"0": ...}, "chunks": {"0": 1-d array, ...}}`.

msgpack's own decoder copies every extension payload into a new `bytes` object, which
flax then decodes with a second copy. Here the file's framing (container headers and
lengths) is walked directly, every scalar token is decoded by the msgpack library, and each
array's bytes are read from the file once, straight into their final (64-byte aligned)
buffer; the chunks of a chunked array land in one buffer with no concatenation.
"""

from __future__ import annotations

import math
import re
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import msgpack
import numpy as np

from ..checkpoints.engine import (
    MAX_DEPTH,
    MAX_NDIM,
    aligned_empty,
    short,
    too_big,
)

_WINDOW = 1 << 20  # framing and scalars are read through a window of this many bytes
_PIECE = 16 << 20  # array data is read in pieces of at most this many bytes...
_PARALLEL_MIN_BYTES = 16 << 20  # ...by several threads once there is this much of it
_MAX_SMALL_EXT = 4096  # a complex or NumPy-scalar payload is a few dozen bytes
_MAX_DTYPE_NAME = 64
_MAX_OBJECTS = 1_000_000  # containers and arrays: far beyond any model's state dict
_EXT_NDARRAY, _EXT_COMPLEX, _EXT_NPSCALAR = 1, 2, 3
CHUNKED = "__msgpack_chunked_array__"
# flax's own rules for picking the latest file in a directory (flax.training.checkpoints).
_SIGNED_FLOAT = re.compile(r"([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)")
_ORBAX_MARKERS = ("checkpoint", "_METADATA", "manifest.ocdbt")
_MPA_PLACEHOLDER = "//GDAPlaceholder:"


@dataclass(frozen=True)
class ArrayRef:
    """An ndarray found in the file, not yet read: where its bytes are and what they are."""

    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]


class Source:
    """Bytes of one open file by absolute offset, read through a small window so that walking
    the framing costs few system calls; array data bypasses the window."""

    def __init__(self, file: Any, size: int, bad: Any):
        self.file, self.size, self.bad = file, size, bad
        self.start, self.window = 0, b""
        self.pending: list[tuple[int, np.ndarray]] = []

    def get(self, pos: int, n: int) -> bytes:
        if n < 0 or pos + n > self.size:
            raise self.bad(
                f"a value at byte {pos} needs {n} bytes but the file ends at byte {self.size} "
                "(truncated)"
            )
        if self.start <= pos and pos + n <= self.start + len(self.window):
            return self.window[pos - self.start : pos - self.start + n]
        if n > _WINDOW:
            out = bytearray(n)
            self.file.read_into(memoryview(out), pos)
            return bytes(out)
        window = bytearray(min(_WINDOW, self.size - pos))
        self.file.read_into(memoryview(window), pos)
        self.start, self.window = pos, bytes(window)
        return self.window[:n]

    def byte(self, pos: int) -> int:
        return self.get(pos, 1)[0]

    def read_into(self, pos: int, out: np.ndarray) -> None:
        """Queues reading `out.nbytes` bytes at `pos` into `out`; `finish` reads them."""
        if out.nbytes:
            flat = out.reshape(-1).view(np.uint8)
            for at in range(0, len(flat), _PIECE):
                self.pending.append((pos + at, flat[at : at + _PIECE]))

    def finish(self) -> None:
        """Reads every queued piece, by several threads when there is much to read: reading
        is mostly page faults and copies, which run in parallel."""
        pieces, self.pending = self.pending, []
        read = lambda job: self.file.read_into(job[1].data, job[0])
        if len(pieces) > 1 and sum(len(p) for _, p in pieces) >= _PARALLEL_MIN_BYTES:
            with ThreadPoolExecutor(max_workers=min(8, len(pieces))) as pool:
                list(pool.map(read, pieces))
        else:
            for job in pieces:
                read(job)


# Sizes of the length field that follows a type byte, for str/bin/array/map/ext.
_LENGTH_BYTES = {
    0xD9: 1, 0xDA: 2, 0xDB: 4,  # str 8/16/32
    0xC4: 1, 0xC5: 2, 0xC6: 4,  # bin 8/16/32
    0xDC: 2, 0xDD: 4,  # array 16/32
    0xDE: 2, 0xDF: 4,  # map 16/32
    0xC7: 1, 0xC8: 2, 0xC9: 4,  # ext 8/16/32
}  # fmt: skip
_FIXED_SIZES = {  # total token size of fixed-width scalars
    0xC0: 1, 0xC2: 1, 0xC3: 1, 0xCA: 5, 0xCB: 9,
    0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9,
}  # fmt: skip
_FIXEXT = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}


@dataclass(frozen=True)
class _Token:
    """The framing of one msgpack value: its kind, where its payload starts, and its payload
    length (bytes for scalars, str, bin, ext; element count for array and map)."""

    kind: str  # "scalar", "array", "map", "ext"
    start: int  # first byte of the token
    body: int  # first byte after the header
    length: int
    ext_code: int = 0

    @property
    def end(self) -> int:  # valid for scalar and ext tokens
        return self.body + self.length


def _token(src: Source, pos: int) -> _Token:
    b = src.byte(pos)
    if b <= 0x7F or b >= 0xE0:
        return _Token("scalar", pos, pos, 1)
    if 0x80 <= b <= 0x8F:
        return _Token("map", pos, pos + 1, b & 0x0F)
    if 0x90 <= b <= 0x9F:
        return _Token("array", pos, pos + 1, b & 0x0F)
    if 0xA0 <= b <= 0xBF:
        return _Token("scalar", pos, pos, 1 + (b & 0x1F))
    if b in _FIXED_SIZES:
        return _Token("scalar", pos, pos, _FIXED_SIZES[b])
    if b in _FIXEXT:
        return _Token("ext", pos, pos + 2, _FIXEXT[b], _signed_byte(src.byte(pos + 1)))
    if b not in _LENGTH_BYTES:
        raise src.bad(f"byte {pos} holds 0x{b:02x}, which is not a msgpack type")
    width = _LENGTH_BYTES[b]
    length = int.from_bytes(src.get(pos + 1, width), "big")
    body = pos + 1 + width
    if b in (0xC7, 0xC8, 0xC9):
        return _Token("ext", pos, body + 1, length, _signed_byte(src.byte(body)))
    if b in (0xDC, 0xDD):
        return _Token("array", pos, body, length)
    if b in (0xDE, 0xDF):
        return _Token("map", pos, body, length)
    return _Token("scalar", pos, pos, body - pos + length)  # str or bin, decoded whole


def _signed_byte(b: int) -> int:
    return b - 256 if b >= 128 else b


def _decode_scalar(src: Source, token: _Token) -> Any:
    raw = src.get(token.start, token.length)
    # The library decodes every scalar, so values are exactly what flax's reader returns.
    try:
        return msgpack.unpackb(raw, raw=False)
    except ValueError as error:  # UnicodeDecodeError is a ValueError
        raise src.bad(f"the value at byte {token.start} does not decode ({error})") from None


def _check_count(src: Source, token: _Token, min_bytes_each: int) -> None:
    # Every element takes at least one byte: a count the rest of the file cannot hold is
    # refused before any container is built.
    if token.length * min_bytes_each > src.size - token.body:
        raise src.bad(
            f"the {token.kind} at byte {token.start} declares {token.length} entries, more "
            f"than the {src.size - token.body} bytes left in the file can hold"
        )


def _dtype(name: Any, src: Source, where: int) -> np.dtype:
    text = name.decode("ascii", "replace") if isinstance(name, bytes) else name
    dtype = None
    if (
        isinstance(text, str)
        and len(text) <= _MAX_DTYPE_NAME
        and text.isidentifier()
        and not text.startswith("_")  # '_np', '__builtins__': attributes, never dtype names
    ):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # NumPy only warns about some odd names
                dtype = np.dtype(getattr(ml_dtypes, text)) if hasattr(ml_dtypes, text) else None
                dtype = dtype or np.dtype(text)
        except (TypeError, ValueError, Warning):
            dtype = None
    # Only plain numeric dtypes (and ml_dtypes' bfloat16/float8/...): a crafted name such as
    # 'O' (Python objects) or 'U8' must never reach np.frombuffer.
    if dtype is None or not (
        dtype.kind in "biufc" or (dtype.type.__module__ == "ml_dtypes" and dtype.itemsize > 0)
    ):
        raise src.bad(f"the array at byte {where} has unsupported dtype {short(name)}")
    return dtype


def _ndarray(src: Source, token: _Token) -> ArrayRef:
    """Parses an ndarray extension payload `[shape, dtype name, bytes]` without reading the
    bytes."""
    header = _token(src, token.body)
    if header.kind != "array" or header.length != 3:
        raise src.bad(f"the array at byte {token.start} is not [shape, dtype, data]")
    shape_token = _token(src, header.body)
    if shape_token.kind != "array" or shape_token.length > MAX_NDIM:
        raise src.bad(f"the array at byte {token.start} has an invalid shape")
    shape, pos = [], shape_token.body
    for _ in range(shape_token.length):
        dim_token = _token(src, pos)
        dim = _decode_scalar(src, dim_token) if dim_token.kind == "scalar" else None
        if type(dim) is not int or dim < 0:
            raise src.bad(f"the array at byte {token.start} has an invalid shape entry")
        shape.append(dim)
        pos = dim_token.end
    name_token = _token(src, pos)
    name = _decode_scalar(src, name_token) if name_token.kind == "scalar" else None
    dtype = _dtype(name, src, token.start)
    if too_big(shape, dtype.itemsize):
        raise src.bad(f"the array at byte {token.start} has an impossible shape {short(shape)}")
    data = _token(src, name_token.end)
    if data.kind != "scalar" or src.byte(data.start) not in (0xC4, 0xC5, 0xC6):
        raise src.bad(f"the array at byte {token.start} has no byte string of data")
    width = _LENGTH_BYTES[src.byte(data.start)]
    offset, nbytes = data.start + 1 + width, data.end - data.start - 1 - width
    if math.prod(shape) * dtype.itemsize != nbytes or data.end != token.end:
        raise src.bad(f"the array at byte {token.start} is {dtype}{shape} but holds {nbytes} bytes")
    if data.end > src.size:
        raise src.bad(f"the array at byte {token.start} runs past the end (truncated)")
    return ArrayRef(offset, dtype, tuple(shape))


def _extension(src: Source, token: _Token) -> Any:
    if token.end > src.size:
        raise src.bad(f"the value at byte {token.start} runs past the end (truncated)")
    if token.ext_code == _EXT_NDARRAY:
        return _ndarray(src, token)
    if token.ext_code not in (_EXT_COMPLEX, _EXT_NPSCALAR):
        raise src.bad(
            f"byte {token.start} holds msgpack extension type {token.ext_code}; flax writes "
            "only 1 (ndarray), 2 (complex) and 3 (NumPy scalar)"
        )
    if token.length > _MAX_SMALL_EXT:
        raise src.bad(f"the scalar at byte {token.start} claims {token.length} bytes")
    if token.ext_code == _EXT_NPSCALAR:
        ref = _ndarray(src, token)
        value = np.frombuffer(
            src.get(ref.offset, math.prod(ref.shape) * ref.dtype.itemsize), ref.dtype
        )
        return value.reshape(ref.shape)[()]
    try:
        pair = msgpack.unpackb(src.get(token.body, token.length))
        return complex(pair[0], pair[1])
    except (ValueError, TypeError, IndexError, KeyError):
        raise src.bad(f"the complex number at byte {token.start} is malformed") from None


def parse(src: Source) -> Any:
    """The one msgpack value the file holds, arrays left as `ArrayRef`s. Iterative, so a
    hostile nesting depth is refused instead of overflowing the stack."""
    # A frame: [container, entries left, is_map, key waiting for its value]
    stack: list[list[Any]] = []
    pos, result, root_done, objects = 0, None, False, 0
    while not root_done:
        if len(stack) > MAX_DEPTH:
            raise src.bad(f"it is nested more than {MAX_DEPTH} levels deep")
        token = _token(src, pos)
        if token.kind in ("array", "map", "ext"):
            # A container or an array costs a few hundred bytes of Python objects but can be
            # one byte of file: bound them, so that a small crafted file cannot take gigabytes.
            objects += 1
            if objects > _MAX_OBJECTS:
                raise src.bad(f"it holds more than {_MAX_OBJECTS} containers and arrays")
        if token.kind in ("array", "map"):
            _check_count(src, token, 2 if token.kind == "map" else 1)
            value: Any = {} if token.kind == "map" else []
            pos = token.body
            if token.length:
                stack.append(
                    [
                        value,
                        token.length * (2 if token.kind == "map" else 1),
                        token.kind == "map",
                        None,
                    ]
                )
                continue
        elif token.kind == "ext":
            value = _extension(src, token)
            pos = token.end
        else:
            value = _decode_scalar(src, token)
            pos = token.end
        # Attach `value` to its parent; close every container it completes.
        while True:
            if not stack:
                result, root_done = value, True
                break
            frame = stack[-1]
            container, _, is_map, key = frame
            frame[1] -= 1
            if not is_map:
                container.append(value)
            elif frame[1] % 2 == 1:  # a key: its value follows
                try:
                    hash(value)
                except TypeError:
                    raise src.bad(f"a map key at byte {token.start} is not hashable") from None
                if isinstance(value, ArrayRef):
                    raise src.bad(f"a map key at byte {token.start} is an array")
                frame[3] = value
            else:
                container[key] = value
            if frame[1]:
                break
            value = stack.pop()[0]
    if pos != src.size:
        raise src.bad(f"it has {src.size - pos} bytes after its msgpack value")
    return result


def _chunked(node: dict[Any, Any], src: Source) -> np.ndarray:
    """The array a chunked array dict stands for, read from its pieces (flax's
    `_unchunk`)."""
    shape, chunks = chunked_spec(node, src)
    out = aligned_empty(shape, chunks[0].dtype)
    flat, at = out.reshape(-1), 0
    for chunk in chunks:
        src.read_into(chunk.offset, flat[at : at + chunk.shape[0]])
        at += chunk.shape[0]
    return out


def chunked_spec(node: dict[Any, Any], src: Source) -> tuple[list[int], list[ArrayRef]]:
    """The shape and pieces of a chunked array dict, validated; no data read."""

    def ordered(entry: Any, what: str) -> list[Any]:
        if not isinstance(entry, dict) or set(entry) != {str(i) for i in range(len(entry))}:
            raise src.bad(
                f"a chunked array's {what} is not a dict keyed by the indices '0', '1' and so on"
            )
        return [entry[str(i)] for i in range(len(entry))]

    shape = ordered(node.get("shape"), "shape")
    chunks = ordered(node.get("chunks"), "chunks")
    if (
        len(shape) > MAX_NDIM
        or not all(type(d) is int and d >= 0 for d in shape)
        or not chunks
        or not all(isinstance(c, ArrayRef) and len(c.shape) == 1 for c in chunks)
        or len({c.dtype for c in chunks}) != 1
        or sum(c.shape[0] for c in chunks) != math.prod(shape)
        or too_big(shape, chunks[0].dtype.itemsize)
    ):
        raise src.bad(
            f"a chunked array (shape {short(shape)}) has chunks that do not make up its shape"
        )
    return shape, chunks


def materialize(root: Any, src: Source) -> Any:
    """Reads every array. Chunked arrays are joined where flax joins them: at the root and
    at dict values reached through dicts only (flax's `_unchunk_array_leaves_in_place`)."""
    if isinstance(root, dict) and CHUNKED in root:
        return _chunked(root, src)
    if isinstance(root, ArrayRef):
        return _read(root, src)
    if not isinstance(root, dict | list):
        return root  # a bare scalar or string, as flax returns it
    stack: list[tuple[Any, bool]] = [(root, isinstance(root, dict))]
    while stack:
        current, through_dicts = stack.pop()
        items = current.items() if isinstance(current, dict) else enumerate(current)
        for key, value in list(items):
            if isinstance(value, ArrayRef):
                current[key] = _read(value, src)
            elif through_dicts and isinstance(value, dict) and CHUNKED in value:
                current[key] = _chunked(value, src)
            elif isinstance(value, dict | list):
                stack.append((value, through_dicts and isinstance(value, dict)))
            elif isinstance(value, str) and value.startswith(_MPA_PLACEHOLDER):
                raise src.bad(
                    f"leaf {short(key)} is a multi-process array that flax's "
                    "save_checkpoint_multiprocess wrote to a separate tensorstore directory, "
                    "which this reader does not read"
                )
    return root


def _read(ref: ArrayRef, src: Source) -> np.ndarray:
    out = aligned_empty(ref.shape, ref.dtype)
    src.read_into(ref.offset, out)
    return out
