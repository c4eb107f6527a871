"""The checkpoint file: the one module that knows the bytes, the leaf kinds and the checksums.

Layout (see docs/checkpoint_format.md), a plain safetensors file:

    [8 bytes: little-endian u64 N][N bytes: JSON header, space-padded][tensor bytes]

The header maps each tensor name (the leaf's key path joined by '.') to its dtype, shape and
byte range, and holds `__metadata__` (string -> string) with our keys:

- `eqx_train.format` / `eqx_train.format_version`: "eqx_train.checkpoint" / "1"
- `eqx_train.step`: the step, as JSON
- `eqx_train.tree`: the tree description (JSON), enough to rebuild the pytree without a target
- `eqx_train.checksums`: xxh3-64 of every tensor (seeded with its dtype and shape) and of the
  tree description; absent in files written before checksums existed.

Everything read from a file is validated before it is trusted or allocated: a malformed file
raises a short `CheckpointFormatError` naming the file and what is wrong.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

if TYPE_CHECKING:
    import jax
    import jax.numpy as jnp
    import jax.tree_util as jtu
else:  # imported on first use: the command line reads headers without JAX
    from .._lazy import LazyModule

    jax = LazyModule("jax")
    jnp = LazyModule("jax.numpy")
    jtu = LazyModule("jax.tree_util")
import xxhash

from .._tree import path_to_name
from . import _transfer

if TYPE_CHECKING:
    from ._storage import Source

FORMAT_NAME = "eqx_train.checkpoint"
FORMAT_VERSION = 1
# A header this big already describes ~100k tensors; parsing JSON costs ~10-30x its size in
# Python objects, so the cap is what bounds a hostile file's memory.
MAX_HEADER_BYTES = 32 * 1024 * 1024
MAX_DEPTH = 200  # nesting of a tree description; deeper trees are refused when saving too
MAX_NDIM = 64
_MIN_BYTES_PER_CONTAINER = 8
_ALIGNMENT = 8
_ALIGN_FOR_DEVICE = 64
_WRITE_CHUNK = 1 << 30  # Linux writes at most ~2 GiB per call; stay well below.
_PARALLEL_MIN_BYTES = 16 << 20
_HASH_CHUNK = 2 << 20
_STREAM_CHUNK = 16 << 20  # bytes per write to an upload stream
_FIRST_READ = 16 << 10  # the first request reads the length field and most headers
CHECKSUM_ALGORITHM = "xxh3_64"
_NO_DIGEST = "0" * 16

STEP_KEY = "eqx_train.step"
TREE_KEY = "eqx_train.tree"
CHECKSUMS_KEY = "eqx_train.checksums"
ARRAYS_KEY = "eqx_train.arrays"  # a .shards index: every array's shape, dtype and pieces
RESERVED_TENSOR_NAMES = frozenset({"__metadata__"})

_DTYPE_TO_CODE: dict[np.dtype, str] = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint16): "U16",
    np.dtype(np.int16): "I16",
    np.dtype(np.uint32): "U32",
    np.dtype(np.int32): "I32",
    np.dtype(np.uint64): "U64",
    np.dtype(np.int64): "I64",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(ml_dtypes.float8_e5m2): "F8_E5M2",
}
CODE_TO_DTYPE = {code: dtype for dtype, code in _DTYPE_TO_CODE.items()}


class CheckpointFormatError(ValueError):
    """A file is not a readable eqx_train/safetensors checkpoint (truncated, corrupt, foreign,
    or its contents fail their checksums)."""


def short(value: Any, limit: int = 80) -> str:
    """`repr(value)`, cut to `limit` characters: error messages stay one line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def dtype_code(dtype: Any, name: str, caller: str) -> str:
    try:
        return _DTYPE_TO_CODE[np.dtype(dtype)]
    except (KeyError, TypeError):
        supported = ", ".join(sorted(str(d) for d in _DTYPE_TO_CODE))
        raise TypeError(
            f"{caller}: leaf '{name}' has dtype {dtype}, which safetensors cannot store. "
            f"Supported dtypes: {supported}."
        ) from None


def hasher(code: str, shape: Sequence[int]) -> Any:
    """The checksum of one tensor, fed in chunks: xxh3-64 of its bytes, seeded by its dtype
    and shape so that a header edit of either is caught too."""
    return xxhash.xxh3_64(seed=zlib.crc32(f"{code}{list(shape)}".encode()))


def _chunks(view: memoryview, size: int = _HASH_CHUNK) -> list[memoryview]:
    # Bytes are hashed chunk by chunk right after they are read or before they are written,
    # while they are still in the CPU cache: the checksum then costs little memory bandwidth.
    return [view[i : i + size] for i in range(0, len(view), size)]


# --------------------------------------------------------------------------------------------
# The leaf kinds: one table, used to describe a tree, rebuild it, and fill a target.


@dataclass(frozen=True)
class Tensor:
    """One tensor to write: its name, a way to get its NumPy value, and the array it came
    from (a `jax.Array` whose shards a multi-process save writes piece by piece). `owned`:
    the source is a snapshot copy made for this save, which the writer frees once written."""

    name: str
    get: Callable[[], np.ndarray]
    dtype: np.dtype
    shape: tuple[int, ...]
    source: Any = None
    owned: bool = False


def is_prng_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


@dataclass(frozen=True)
class LeafKind:
    """How one kind of leaf is saved (as a 0-d or n-d tensor), rebuilt without a target, and
    checked against a target leaf of the same kind."""

    name: str
    test: Callable[[Any], bool]
    data: Callable[[Any], Any]  # the leaf as an array-like with .dtype/.shape
    rebuild: Callable[[np.ndarray, dict[str, Any]], Any]
    fill: Callable[[Any, np.ndarray], Any]  # (target leaf, file array) -> restored leaf
    scalar_type: type | None = None  # Python scalars: any dtype whose value converts exactly


def _wrap_key(array: np.ndarray, impl: Any) -> Any:
    return jax.random.wrap_key_data(jnp.asarray(array), impl=impl)


def _place(array: Any, like: Any) -> Any:
    sharding = getattr(like, "sharding", None)
    return jax.device_put(array, sharding) if sharding is not None else jax.device_put(array)


def _exact_scalar(kind: type) -> Callable[[Any, np.ndarray], Any]:
    def fill(leaf: Any, array: np.ndarray) -> Any:
        value = array[()].item()  # a Python number: comparisons below are exact
        try:
            converted = type(leaf)(value)
        except (ValueError, OverflowError, TypeError):
            converted = None
        same = converted is not None and (
            converted == value
            or (isinstance(converted, float) and math.isnan(converted) and math.isnan(value))
        )
        if not same or (kind is not bool and isinstance(value, bool)):
            raise ValueError(
                f"the file holds {short(value)} ({array.dtype}), not exactly a {kind.__name__}"
            )
        return converted

    return fill


LEAF_KINDS: tuple[LeafKind, ...] = (
    LeafKind(
        "prng_key",
        is_prng_key,
        lambda key: jax.random.key_data(key),
        lambda a, entry: _wrap_key(a, entry["impl"]),
        lambda leaf, a: _place(_wrap_key(a, jax.random.key_impl(leaf)), leaf),
    ),
    LeafKind(
        "array",
        lambda x: isinstance(x, jax.Array | np.ndarray | jax.ShapeDtypeStruct),
        lambda x: x,
        lambda a, entry: a,
        lambda leaf, a: a if isinstance(leaf, np.ndarray) else _place(a, leaf),
    ),
    LeafKind(
        "numpy_scalar",
        lambda x: isinstance(x, np.generic),
        np.asarray,
        lambda a, entry: a[()],
        lambda leaf, a: a[()],
    ),
    # bool before int before float: an IntEnum is an int, bool is an int too.
    LeafKind(
        "bool",
        lambda x: isinstance(x, bool),
        lambda x: np.asarray(x, np.bool_),
        lambda a, entry: bool(a.item()),
        _exact_scalar(bool),
        bool,
    ),
    LeafKind(
        "int",
        lambda x: isinstance(x, int),
        lambda x: np.asarray(x, np.int64),
        lambda a, entry: int(a.item()),
        _exact_scalar(int),
        int,
    ),
    LeafKind(
        "float",
        lambda x: isinstance(x, float),
        lambda x: np.asarray(x, np.float64),
        lambda a, entry: float(a.item()),
        _exact_scalar(float),
        float,
    ),
)
KIND_BY_NAME = {kind.name: kind for kind in LEAF_KINDS}


def kind_of(leaf: Any) -> LeafKind | None:
    """The kind of a tensor leaf, or None for leaves that are not data (str, functions...)."""
    return next((kind for kind in LEAF_KINDS if kind.test(leaf)), None)


# --------------------------------------------------------------------------------------------
# Tree description: pytree <-> JSON.


def _children(node: Any) -> list[tuple[Any, Any]] | None:
    """One level of flattening as [(key, child)]; None when `node` is a leaf. Empty
    containers ({}, [], an optax EmptyState) are nodes with no children, not leaves."""
    pairs, treedef = jtu.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return None
    return [(path[0], child) for path, child in pairs]


def describe(tree: Any, *, caller: str, allow_global: bool = False) -> tuple[Any, list[Tensor]]:
    """The JSON description of `tree` and its tensors in order. Raises, before anything is
    written, naming the leaf path, for what cannot be saved faithfully."""
    tensors: list[Tensor] = []
    seen: set[str] = set()

    def add_tensor(keys: tuple[Any, ...], kind: LeafKind, leaf: Any) -> dict[str, Any]:
        name = path_to_name(keys)
        if name in RESERVED_TENSOR_NAMES:
            raise ValueError(
                f"{caller}: the tensor name '{name}' is reserved by the safetensors format "
                "(it holds the file's metadata). Rename that key."
            )
        if name in seen:
            raise ValueError(
                f"{caller}: two leaves map to the tensor name '{name}' (a key contains '.' "
                "or keys differ only in type, e.g. 1 and '1'). Rename the keys."
            )
        seen.add(name)
        if kind.name == "int" and not -(2**63) <= leaf < 2**63:
            raise OverflowError(
                f"{caller}: leaf '{name}' is the int {short(leaf)}, which does not fit in int64."
            )
        data = kind.data(leaf)
        if not allow_global and isinstance(data, jax.Array) and not data.is_fully_addressable:
            raise ValueError(
                f"{caller}: leaf '{name}' is a jax.Array spread over several processes (not "
                "fully addressable), so no single process can write it. In a multi-process "
                "job use save_checkpoint_multiprocess, called on every process."
            )
        dtype_code(data.dtype, name, caller)
        if isinstance(data, jax.ShapeDtypeStruct):
            raise TypeError(f"{caller}: leaf '{name}' is a ShapeDtypeStruct, which holds no data.")
        tensors.append(
            Tensor(
                name,
                (lambda d=data: np.asarray(d)),
                np.dtype(data.dtype),
                tuple(int(s) for s in data.shape),
                data,
            )
        )
        entry: dict[str, Any] = {"tensor": name, "kind": kind.name}
        if kind.name == "prng_key":
            entry["impl"] = str(jax.random.key_impl(leaf))
        return entry

    def visit(node: Any, keys: tuple[Any, ...]) -> Any:
        if len(keys) > MAX_DEPTH:
            raise ValueError(
                f"{caller}: the tree is nested more than {MAX_DEPTH} levels deep at "
                f"'{path_to_name(keys)}'."
            )
        if node is None:
            return None
        if isinstance(node, np.ma.MaskedArray) or (
            isinstance(node, numbers.Number) and not isinstance(node, np.generic | int | float)
        ):
            raise TypeError(
                f"{caller}: leaf '{path_to_name(keys)}' is a {type(node).__name__}, which cannot "
                "be saved faithfully (complex, Decimal, Fraction and masked arrays are refused "
                "rather than dropped); convert it to an array of a supported dtype."
            )
        kind = kind_of(node)
        if kind is not None:
            return add_tensor(keys, kind, node)
        if isinstance(node, str):
            return {"str": node}
        pairs = _children(node)
        if pairs is None:
            return {"skipped": type(node).__qualname__}
        if isinstance(node, dict):
            entries = []
            for key, child in pairs:
                raw = key.key
                if not isinstance(raw, str | int) or isinstance(raw, bool):
                    raise TypeError(
                        f"{caller}: dict at '{path_to_name(keys)}' has key {short(raw)} of type "
                        f"{type(raw).__name__}; only str and int keys can be saved."
                    )
                entries.append(
                    [
                        str.__str__(raw) if isinstance(raw, str) else int(raw),
                        visit(child, (*keys, key)),
                    ]
                )
            return {"dict": entries}
        if type(node) in (list, tuple):
            return {type(node).__name__: [visit(child, (*keys, key)) for key, child in pairs]}
        # Any other pytree node (Equinox module, namedtuple, dataclass): named children.
        return {
            "node": type(node).__qualname__,
            "children": [[path_to_name((k,)), visit(c, (*keys, k))] for k, c in pairs],
        }

    return visit(tree, ()), tensors


def parse_description(
    text: str,
    shapes: Mapping[str, tuple[tuple[int, ...], np.dtype]],
    bad: Callable[[str], Exception],
) -> Any:
    """The tree description of a layout whose tensors (`name -> (shape, dtype)`) are spread
    over several files: parsed, and validated against those tensors."""
    infos = {name: TensorInfo(name, dtype, shape, 0, 0) for name, (shape, dtype) in shapes.items()}
    description = parse_json(text, "the tree description", bad)
    validate_description(description, infos, bad)
    return description


def validate_description(description: Any, tensors: dict[str, TensorInfo], bad: Any) -> None:
    """Checks that a description read from a file is well formed and names exactly the
    file's tensors, each once, with a dtype/shape its kind can hold. Iterative: a hostile
    nesting depth cannot overflow the stack."""
    named: set[str] = set()
    stack: list[tuple[Any, int]] = [(description, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad(f"the tree description is nested more than {MAX_DEPTH} levels deep")
        if node is None:
            continue
        if not isinstance(node, dict) or len(node) not in (1, 2, 3):
            raise bad(f"the tree description has an invalid entry {short(node)}")
        if "tensor" in node:
            kind_name = node.get("kind", "array")
            name = node.get("tensor")
            kind = KIND_BY_NAME.get(kind_name) if isinstance(kind_name, str) else None
            extra = set(node) - {"tensor", "kind", "impl"}
            if not isinstance(name, str) or kind is None or extra:
                raise bad(f"the tree description has an invalid tensor entry {short(node)}")
            if (kind.name == "prng_key") != isinstance(node.get("impl"), str):
                raise bad(f"the tree description has an invalid tensor entry {short(node)}")
            if name not in tensors:
                raise bad(f"the tree names tensor {short(name)}, which the file lacks")
            if name in named:
                raise bad(f"the tree names tensor {short(name)} twice")
            named.add(name)
            info = tensors[name]
            if kind.scalar_type is not None or kind.name == "numpy_scalar":
                wanted = {"bool": "b", "int": "iu", "float": "f"}.get(kind.name, "biuf")
                if info.shape != () or (
                    kind.name != "numpy_scalar" and info.dtype.kind not in wanted
                ):
                    raise bad(
                        f"tensor {short(name)} is a {kind.name} leaf but is stored as "
                        f"{info.dtype}{list(info.shape)}"
                    )
            continue
        ((tag, value),) = node.items() if len(node) == 1 else (("node", node),)
        if tag in ("str", "skipped") and isinstance(value, str):
            continue
        if tag in ("list", "tuple") and isinstance(value, list):
            stack.extend((child, depth + 1) for child in value)
            continue
        if tag == "dict" and isinstance(value, list):
            keys = []
            for item in value:
                if not (
                    isinstance(item, list)
                    and len(item) == 2
                    and isinstance(item[0], str | int)
                    and not isinstance(item[0], bool)
                ):
                    raise bad(f"the tree description has an invalid dict item {short(item)}")
                keys.append(item[0])
                stack.append((item[1], depth + 1))
            if len(set(keys)) != len(keys):
                raise bad("the tree description has a dict with a repeated key")
            continue
        if tag == "node" and set(node) == {"node", "children"}:
            children = node["children"]
            if isinstance(node["node"], str) and isinstance(children, list):
                fields = []
                for item in children:
                    if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
                        raise bad(f"the tree description has an invalid field {short(item)}")
                    fields.append(item[0])
                    stack.append((item[1], depth + 1))
                if len(set(fields)) != len(fields):
                    raise bad("the tree description has a node with a repeated field")
                continue
        raise bad(f"the tree description has an invalid entry {short(node)}")
    unnamed = set(tensors) - named
    if unnamed:
        raise bad(f"the file has tensors the tree does not name: {short(sorted(unnamed)[:5])}")


_EMPTY_CONTAINERS = {"dict": dict, "list": list, "tuple": tuple}


def rebuild(description: Any, load: Callable[[str], np.ndarray]) -> Any:
    """The pytree a (validated) description stands for, `load(name)` giving each tensor.

    Custom nodes come back as dicts of their children, skipped leaves as None.
    """

    def visit(d: Any) -> Any:
        if d is None:
            return None
        if "tensor" in d:
            return KIND_BY_NAME[d.get("kind", "array")].rebuild(load(d["tensor"]), d)
        if "str" in d:
            return d["str"]
        if "skipped" in d:
            # Files written before empty containers were described recorded them as skipped.
            empty = _EMPTY_CONTAINERS.get(d["skipped"])
            return None if empty is None else empty()
        if "dict" in d:
            return {key: visit(child) for key, child in d["dict"]}
        if "list" in d:
            return [visit(child) for child in d["list"]]
        if "tuple" in d:
            return tuple(visit(child) for child in d["tuple"])
        return {key: visit(child) for key, child in d["children"]}

    return visit(description)


# --------------------------------------------------------------------------------------------
# Header: encode when writing, parse and validate when reading.


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute file offset
    nbytes: int
    checksum: str | None = None

    @property
    def code(self) -> str:
        return _DTYPE_TO_CODE[self.dtype]


def base_metadata(step_text: str, description: Any) -> dict[str, str]:
    """The `__metadata__` entries every eqx_train checkpoint (file or index) carries."""
    return {
        "eqx_train.format": FORMAT_NAME,
        "eqx_train.format_version": str(FORMAT_VERSION),
        STEP_KEY: step_text,
        TREE_KEY: json.dumps(description, separators=(",", ":")),
    }


def _encode_header(
    tensors: Sequence[Tensor], metadata: dict[str, str], digests: Sequence[str]
) -> bytes:
    checksums = {
        "algorithm": CHECKSUM_ALGORITHM,
        "metadata": {key: _text_digest(value) for key, value in metadata.items()},
        "tensors": {t.name: d for t, d in zip(tensors, digests, strict=True)},
    }
    entries: dict[str, Any] = {
        "__metadata__": {**metadata, CHECKSUMS_KEY: json.dumps(checksums, separators=(",", ":"))}
    }
    offset = 0
    for t in tensors:
        nbytes = math.prod(t.shape) * t.dtype.itemsize
        entries[t.name] = {
            "dtype": _DTYPE_TO_CODE[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % _ALIGNMENT)
    if len(raw) > MAX_HEADER_BYTES:
        raise ValueError(
            f"the checkpoint header would be {len(raw)} bytes, more than the "
            f"{MAX_HEADER_BYTES} a reader accepts; save fewer, larger leaves."
        )
    return len(raw).to_bytes(8, "little") + raw


def check_header_size(tensors: Sequence[Tensor], metadata: dict[str, str], caller: str) -> None:
    """Raises before anything is written if the file's header would be too big to read."""
    try:
        _encode_header(tensors, metadata, [_NO_DIGEST] * len(tensors))
    except ValueError as error:
        raise ValueError(f"{caller}: {error}") from None


def _text_digest(text: str) -> str:
    # surrogatepass: a crafted header may hold lone surrogates, which must hash, not crash.
    return xxhash.xxh3_64_hexdigest(text.encode("utf-8", "surrogatepass"))


def _as_bytes(array: np.ndarray) -> memoryview:
    flat = np.ascontiguousarray(array).reshape(-1)
    return flat.view(np.uint8).data


def write_all(fd: int, data: memoryview) -> None:
    """Writes every byte of `data` to `fd` (os.write may write fewer bytes than asked)."""
    view = data
    while len(view):
        written = os.write(fd, view[:_WRITE_CHUNK])
        view = view[written:]


def write_file(out: Any, tensors: Sequence[Tensor], metadata: dict[str, str]) -> None:
    """The one writer, to a file descriptor (`out: int`) or a binary stream (an upload).

    Leaves reach the host through the transfer pipeline (`_transfer.host_arrays`): the
    transfers of the next leaves run while the current one is hashed and written, and at
    most the save's `host_window_bytes` of leaf bytes (at least one leaf) are held on the
    host (`_transfer.host_window_bytes` sets it around a save's commit).

    To a file descriptor: the header, then each tensor's bytes hashed and written in turn,
    then the header again with the real checksums (digests have a fixed width, so it has
    exactly the first one's length). A stream cannot be rewritten, so there the leaves go
    through the pipeline twice: once to hash them for the header, once to write them
    (hashed again: a leaf that changed in between is refused rather than written under a
    wrong checksum).
    """
    window = _transfer.current_window()
    if isinstance(out, int):
        _write_to_fd(out, tensors, metadata, window)
        return
    digests = []
    with closing(_transfer.host_arrays(tensors, window, final=False)) as leaves:
        for t, array in leaves:
            check = hasher(_DTYPE_TO_CODE[t.dtype], t.shape)
            for chunk in _chunks(_as_bytes(array)):
                check.update(chunk)
            digests.append(check.hexdigest())
    out.write(_encode_header(tensors, metadata, digests))
    with closing(_transfer.host_arrays(tensors, window)) as leaves:
        for (t, array), digest in zip(leaves, digests, strict=True):
            check = hasher(_DTYPE_TO_CODE[t.dtype], t.shape)
            for block in _chunks(_as_bytes(array), _STREAM_CHUNK):
                for chunk in _chunks(block):
                    check.update(chunk)
                out.write(block)
            if check.hexdigest() != digest:
                raise RuntimeError(
                    f"save_checkpoint: leaf '{t.name}' changed while it was being saved."
                )


def _write_to_fd(
    fd: int, tensors: Sequence[Tensor], metadata: dict[str, str], window: _transfer.HostWindow
) -> None:
    placeholder = _encode_header(tensors, metadata, [_NO_DIGEST] * len(tensors))
    write_all(fd, memoryview(placeholder))
    digests = []
    with closing(_transfer.host_arrays(tensors, window)) as leaves:
        for t, array in leaves:
            check = hasher(_DTYPE_TO_CODE[t.dtype], t.shape)
            for chunk in _chunks(_as_bytes(array)):
                check.update(chunk)
                write_all(fd, chunk)
            digests.append(check.hexdigest())
    header = _encode_header(tensors, metadata, digests)
    if len(header) != len(placeholder):  # pragma: no cover - digests are fixed-width hex
        raise AssertionError("checkpoint header changed length")
    view, done = memoryview(header), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], done)


def normalize_index(index: Sequence[slice], shape: Sequence[int]) -> tuple[slice, ...]:
    """`index` with explicit, clipped bounds in every dimension (a sharding's slices use None)."""
    if len(index) != len(shape):
        raise ValueError(f"index {short(index)} does not match a tensor of shape {list(shape)}")
    return tuple(slice(*s.indices(d)[:2]) for s, d in zip(index, shape, strict=True))


def too_big(shape: Sequence[int], itemsize: int) -> bool:
    """Whether NumPy would refuse to make an array of this shape even when it is empty (it
    bounds the product of the dimensions counted as at least 1, in bytes)."""
    return math.prod(max(d, 1) for d in shape) * max(itemsize, 1) >= 2**62


def aligned_empty(shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary: XLA's CPU client then
    adopts it without a copy when it is placed on a device (`jax.device_put`)."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN_FOR_DEVICE, dtype=np.uint8)
    start = -raw.ctypes.data % _ALIGN_FOR_DEVICE
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("a JSON object repeats a key")
    return result


def parse_json(raw: bytes | str, what: str, bad: Callable[[str], Exception]) -> Any:
    try:
        return json.loads(raw, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise bad(f"{what} is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as error:
        raise bad(f"{what} is not valid JSON ({short(str(error), 120)})") from None


def _is_count(x: Any) -> bool:
    return type(x) is int and x >= 0


class FileReader:
    """One open safetensors file: its validated header and reads of its tensors, all through
    one file descriptor (a save that replaces the file meanwhile cannot mix two versions).

    Use as a context manager. Non-regular files (a FIFO, a directory) are refused without
    blocking.
    """

    def __init__(self, path: str, source: Source | None = None):
        self.path = path
        if source is None:
            from ._storage import LocalStorage

            source = LocalStorage().open(path)
        self.source = source
        try:
            self._parse()
        except BaseException:
            source.close()
            raise

    def bad(self, why: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self.path} is not a valid checkpoint: {why}.")

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        first = bytearray(8 if self.source.is_local else min(size, _FIRST_READ))
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
        metadata = entries.pop("__metadata__", {})
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self.bad("__metadata__ must map strings to strings")
        version = metadata.get("eqx_train.format_version")
        if version is not None and version != str(FORMAT_VERSION):
            raise self.bad(
                f"it has eqx_train format version {short(version)}; this eqx_train reads "
                f"version {FORMAT_VERSION}"
            )
        checksums = self._checksums(metadata, set(entries))
        data_start = 8 + header_len
        data_size = size - data_start
        tensors: dict[str, TensorInfo] = {}
        spans = []
        for name, entry in entries.items():
            if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
                raise self.bad(f"tensor {short(name)} has a malformed entry {short(entry)}")
            code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not isinstance(code, str) or code not in CODE_TO_DTYPE:
                raise self.bad(f"tensor {short(name)} has unsupported dtype {short(code)}")
            if (
                not isinstance(shape, list)
                or len(shape) > MAX_NDIM
                or not all(_is_count(s) for s in shape)
                or too_big(shape, CODE_TO_DTYPE[code].itemsize)
            ):
                raise self.bad(f"tensor {short(name)} has an invalid shape {short(shape)}")
            if not (
                isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))
            ):
                raise self.bad(f"tensor {short(name)} has invalid data offsets {short(offsets)}")
            begin, end = offsets
            dtype = CODE_TO_DTYPE[code]
            nbytes = math.prod(shape) * dtype.itemsize
            if not begin <= end <= data_size or end - begin != nbytes:
                raise self.bad(
                    f"tensor {short(name)} claims bytes [{begin}, {end}) for "
                    f"{code}{short(shape)}, but the data section has {data_size} bytes"
                )
            checksum = None if checksums is None else checksums[name]
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

    def _checksums(self, metadata: dict[str, str], names: set[str]) -> dict[str, str] | None:
        raw = metadata.get(CHECKSUMS_KEY)
        if raw is None:
            return None  # written before checksums existed: nothing to verify
        parsed = parse_json(raw, "the checksum table", self.bad)
        ok = (
            isinstance(parsed, dict)
            and parsed.get("algorithm") == CHECKSUM_ALGORITHM
            and isinstance(parsed.get("metadata"), dict)
            and isinstance(parsed.get("tensors"), dict)
            and all(isinstance(v, str) and len(v) == 16 for v in parsed["tensors"].values())
        )
        if not ok:
            raise self.bad("its checksum table is malformed")
        table: dict[str, str] = parsed["tensors"]
        if set(table) != names:
            odd = sorted(set(table) ^ names)[:5]
            raise self.bad(f"its checksum table and its tensors disagree on the names {short(odd)}")
        sealed: dict[str, Any] = parsed["metadata"]
        for key in set(metadata) - {CHECKSUMS_KEY} | set(sealed):
            value = metadata.get(key)
            if value is None or sealed.get(key) != _text_digest(value):
                what = "tree description" if key == TREE_KEY else f"metadata {short(key)}"
                raise self.bad(f"its {what} fails its checksum")
        return table

    # ------------------------------------------------------------------ contents

    @property
    def has_description(self) -> bool:
        """False for a safetensors file written by another tool (no tree description)."""
        return TREE_KEY in self.metadata

    @property
    def description(self) -> Any:
        """The validated tree description."""
        if self._description is None:
            description = parse_json(self.metadata[TREE_KEY], "the tree description", self.bad)
            validate_description(description, self.tensors, self.bad)
            self._description = description
        return self._description

    def arrays(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {name: (info.shape, info.dtype) for name, info in self.tensors.items()}

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
            self.source.read_into(_as_bytes(rows), info.start + first * row_bytes)
        return rows[(slice(None), *index[1:])].copy() if len(index) > 1 else rows

    def _fill(self, info: TensorInfo, out: np.ndarray, verify: bool) -> None:
        """Reads tensor `info` into `out` (and checks it). Locally chunk by chunk, each
        hashed while still in cache; from an object store in parallel ranged requests."""
        view = _as_bytes(out) if info.nbytes else memoryview(b"")
        check = hasher(info.code, info.shape) if verify and info.checksum else None
        if not self.source.is_local:
            self.source.read_ranges([(view, info.start)])
            if check is not None:
                for chunk in _chunks(view):
                    check.update(chunk)
        else:
            offset = info.start
            for chunk in _chunks(view):
                self.source.read_into(chunk, offset)
                offset += len(chunk)
                if check is not None:
                    check.update(chunk)
        if check is not None and check.hexdigest() != info.checksum:
            raise self.bad(f"tensor '{info.name}' fails its checksum (the data is corrupt)")

    def read_many(
        self, names: Sequence[str], *, verify: bool = True, parallel: bool = True
    ) -> dict[str, np.ndarray]:
        """Whole tensors, read (and verified) by several threads when they are large."""
        if not self.source.is_local:
            # An object store: every range at once, so requests overlap.
            infos = [self.tensors[n] for n in names]
            outs = [aligned_empty(i.shape, i.dtype) for i in infos]
            self.source.read_ranges(
                [(_as_bytes(o), i.start) for o, i in zip(outs, infos, strict=True) if i.nbytes]
            )
            for info, out in zip(infos, outs, strict=True):
                if verify and info.checksum:
                    check = hasher(info.code, info.shape)
                    for chunk in _chunks(_as_bytes(out) if info.nbytes else memoryview(b"")):
                        check.update(chunk)
                    if check.hexdigest() != info.checksum:
                        raise self.bad(
                            f"tensor '{info.name}' fails its checksum (the data is corrupt)"
                        )
            return dict(zip(names, outs, strict=True))
        total = sum(self.tensors[n].nbytes for n in names)
        if parallel and len(names) > 1 and total >= _PARALLEL_MIN_BYTES:
            with ThreadPoolExecutor(max_workers=min(8, len(names))) as pool:
                arrays = list(pool.map(lambda n: self.read(n, verify=verify), names))
        else:
            arrays = [self.read(n, verify=verify) for n in names]
        return dict(zip(names, arrays, strict=True))
