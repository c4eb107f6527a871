"""The checkpoint file: a plain safetensors file plus a JSON tree description in its metadata.

This is the one module that knows the bytes. Layout (see docs/checkpoint_format.md):

    [8 bytes: little-endian u64 N][N bytes: JSON header, space-padded][tensor bytes]

The header maps each tensor name (the leaf's key path joined by '.') to its dtype, shape and
byte range, and holds `__metadata__` (string -> string) with our keys:

- `eqx_train.format`: "eqx_train.checkpoint"
- `eqx_train.format_version`: "1"
- `eqx_train.step`: the step, as JSON
- `eqx_train.tree`: the tree description (JSON), enough to rebuild the pytree without a target.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._tree import key_to_str

FORMAT_NAME = "eqx_train.checkpoint"
FORMAT_VERSION = 1
MAX_HEADER_BYTES = 100 * 1024 * 1024
_ALIGNMENT = 8
_WRITE_CHUNK = 1 << 30  # Linux writes at most ~2 GiB per call; stay well below.

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
    np.dtype(jnp.bfloat16): "BF16",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(jnp.float8_e4m3fn): "F8_E4M3",
    np.dtype(jnp.float8_e5m2): "F8_E5M2",
}
_CODE_TO_DTYPE = {code: dtype for dtype, code in _DTYPE_TO_CODE.items()}


class CheckpointFormatError(ValueError):
    """A file is not a readable eqx_train/safetensors checkpoint (truncated, corrupt, foreign)."""


def dtype_code(dtype: np.dtype, name: str) -> str:
    try:
        return _DTYPE_TO_CODE[np.dtype(dtype)]
    except KeyError:
        supported = ", ".join(sorted(str(d) for d in _DTYPE_TO_CODE))
        raise TypeError(
            f"save_checkpoint: leaf '{name}' has dtype {dtype}, which safetensors cannot store. "
            f"Supported dtypes: {supported}."
        ) from None


# --------------------------------------------------------------------------------------------
# Tree description: pytree <-> JSON. Array-like leaves become tensors; the rest is described.


@dataclass(frozen=True)
class TensorLeaf:
    """One tensor to write: its name, a way to get its NumPy value, and the array it came
    from (a `jax.Array` whose shards the multi-process save writes piece by piece)."""

    name: str
    get: Callable[[], np.ndarray]
    dtype: np.dtype
    shape: tuple[int, ...]
    source: Any = None


def snapshot(tensor: TensorLeaf) -> TensorLeaf:
    """The tensor with its value copied to host memory now (for saves that finish later,
    after the caller may have mutated or donated the buffers)."""
    value = np.array(tensor.get(), copy=True)
    return replace(tensor, get=lambda: value)


def is_prng_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _children(node: Any) -> tuple[list[tuple[Any, Any]], Any] | None:
    """One level of flattening: [(key, child)], treedef; None when `node` is a leaf."""
    pairs, treedef = jtu.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if jtu.treedef_is_leaf(treedef) and node is not None:
        return None
    return [(path[0], child) for path, child in pairs], treedef


def describe(tree: Any, *, allow_global: bool = False) -> tuple[Any, list[TensorLeaf]]:
    """The JSON description of `tree` and the tensors to write, in order.

    Raises TypeError/ValueError naming the leaf path for things that cannot be saved, and
    (unless `allow_global`) for arrays spread over several processes.
    """
    tensors: list[TensorLeaf] = []
    seen: dict[str, str] = {}

    def add_tensor(
        path: tuple[str, ...], get: Callable[[], np.ndarray], dtype, shape, source=None
    ) -> str:
        name = ".".join(path) if path else "<root>"
        if not allow_global and isinstance(source, jax.Array) and not source.is_fully_addressable:
            raise ValueError(
                f"save_checkpoint: leaf '{name}' is a jax.Array spread over several processes "
                "(not fully addressable), so no single process can write it. In a "
                "multi-process job use save_checkpoint_multiprocess, called on every process."
            )
        if name in seen:
            raise ValueError(
                f"save_checkpoint: two leaves map to the tensor name '{name}' (a key contains "
                "'.' or keys differ only in type, e.g. 1 and '1'). Rename the keys."
            )
        seen[name] = name
        dtype_code(dtype, name)
        tensors.append(TensorLeaf(name, get, np.dtype(dtype), tuple(int(s) for s in shape), source))
        return name

    def visit(node: Any, path: tuple[str, ...]) -> Any:
        if node is None:
            return None
        if is_prng_key(node):
            data = jax.random.key_data(node)
            impl = str(jax.random.key_impl(node))
            name = add_tensor(path, lambda d=data: np.asarray(d), data.dtype, data.shape, data)
            return {"tensor": name, "kind": "prng_key", "impl": impl}
        if isinstance(node, jax.Array):
            return {
                "tensor": add_tensor(
                    path, lambda n=node: np.asarray(n), node.dtype, node.shape, node
                ),
                "kind": "array",
            }
        if isinstance(node, np.ndarray):
            return {
                "tensor": add_tensor(path, lambda n=node: n, node.dtype, node.shape),
                "kind": "array",
            }
        if isinstance(node, np.generic):
            value = np.asarray(node)
            return {
                "tensor": add_tensor(path, lambda v=value: v, value.dtype, ()),
                "kind": "numpy_scalar",
            }
        if isinstance(node, bool | int | float) and not isinstance(node, np.generic):
            kind = type(node).__name__ if type(node) in (bool, int, float) else "float"
            if kind == "int" and not -(2**63) <= node < 2**63:
                raise OverflowError(
                    f"save_checkpoint: leaf '{'.'.join(path)}' is the int {node}, which does "
                    "not fit in int64."
                )
            value = np.asarray(
                node, dtype={"bool": np.bool_, "int": np.int64}.get(kind, np.float64)
            )
            return {"tensor": add_tensor(path, lambda v=value: v, value.dtype, ()), "kind": kind}
        if isinstance(node, str):
            return {"str": node}
        level = _children(node)
        if level is None:
            return {"skipped": type(node).__qualname__}
        pairs, _ = level
        if isinstance(node, dict):
            entries = []
            for key, child in pairs:
                raw = key.key
                if not isinstance(raw, str | int) or isinstance(raw, bool):
                    raise TypeError(
                        f"save_checkpoint: dict at '{'.'.join(path) or '<root>'}' has key "
                        f"{raw!r} of type {type(raw).__name__}; only str and int keys can be "
                        "saved."
                    )
                entries.append([raw, visit(child, (*path, str(raw)))])
            return {"dict": entries}
        if type(node) in (list, tuple):
            kind = type(node).__name__
            return {kind: [visit(child, (*path, str(i))) for i, (_, child) in enumerate(pairs)]}
        # Any other pytree node (Equinox module, namedtuple, dataclass): named children.
        return {
            "node": type(node).__qualname__,
            "children": [[key_to_str(k), visit(c, (*path, key_to_str(k)))] for k, c in pairs],
        }

    return visit(tree, ()), tensors


def rebuild(description: Any, load: Callable[[str], np.ndarray]) -> Any:
    """The pytree a description stands for, with `load(name)` giving each tensor's array.

    Custom nodes come back as dicts of their children; skipped leaves as None.
    """

    def visit(d: Any) -> Any:
        if d is None:
            return None
        if "tensor" in d:
            array = load(d["tensor"])
            kind = d.get("kind", "array")
            if kind == "prng_key":
                return jax.random.wrap_key_data(jnp.asarray(array), impl=d["impl"])
            if kind in ("int", "float", "bool"):
                return {"int": int, "float": float, "bool": bool}[kind](array.item())
            if kind == "numpy_scalar":
                return array[()]
            return array
        if "str" in d:
            return d["str"]
        if "skipped" in d:
            return None
        if "dict" in d:
            return {key: visit(child) for key, child in d["dict"]}
        if "list" in d:
            return [visit(child) for child in d["list"]]
        if "tuple" in d:
            return tuple(visit(child) for child in d["tuple"])
        if "node" in d:
            return {key: visit(child) for key, child in d["children"]}
        raise CheckpointFormatError(f"unknown tree description entry {d!r}")

    return visit(description)


def tensor_kinds(description: Any) -> dict[str, dict[str, Any]]:
    """Every tensor entry of a description, by tensor name."""
    found: dict[str, dict[str, Any]] = {}

    def visit(d: Any) -> None:
        if isinstance(d, dict):
            if "tensor" in d:
                found[d["tensor"]] = d
                return
            for value in d.values():
                visit(value)
        elif isinstance(d, list):
            for value in d:
                visit(value)

    visit(description)
    return found


# --------------------------------------------------------------------------------------------
# Header: encode when writing, parse and validate when reading.


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute file offset
    nbytes: int


@dataclass(frozen=True)
class Header:
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    path: str

    @property
    def step(self) -> Any:
        raw = self.metadata.get("eqx_train.step")
        return None if raw is None else json.loads(raw)

    @property
    def has_description(self) -> bool:
        """False for a safetensors file written by another tool (no tree description)."""
        return "eqx_train.tree" in self.metadata

    @property
    def description(self) -> Any:
        return json.loads(self.metadata["eqx_train.tree"])


def base_metadata(step: Any, description: Any) -> dict[str, str]:
    """The `__metadata__` entries every eqx_train checkpoint (file or index) carries."""
    return {
        "eqx_train.format": FORMAT_NAME,
        "eqx_train.format_version": str(FORMAT_VERSION),
        "eqx_train.step": json.dumps(step if isinstance(step, int | float) else step.item()),
        "eqx_train.tree": json.dumps(description, separators=(",", ":")),
    }


def encode_header(tensors: Sequence[TensorLeaf], metadata: dict[str, str]) -> bytes:
    entries: dict[str, Any] = {"__metadata__": metadata}
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
    return len(raw).to_bytes(8, "little") + raw


def read_header(path: str) -> Header:
    """Parses and validates the header of the safetensors file at `path`.

    Checks sizes against the real file size before allocating anything, so a truncated or
    hostile file raises CheckpointFormatError naming the file.
    """

    def bad(why: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{path} is not a valid checkpoint: {why}.")

    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        if file_size < 8:
            raise bad(f"the file has {file_size} bytes, fewer than the 8-byte header length")
        header_len = int.from_bytes(f.read(8), "little")
        if header_len > min(MAX_HEADER_BYTES, file_size - 8):
            raise bad(
                f"the header claims {header_len} bytes but the file has {file_size - 8} after "
                "the length field (truncated or not a safetensors file)"
            )
        raw = f.read(header_len)
    try:
        entries = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise bad(f"the header is not JSON ({error})") from None
    if not isinstance(entries, dict):
        raise bad("the header is not a JSON object")
    metadata = entries.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise bad("__metadata__ must map strings to strings")
    data_start = 8 + header_len
    data_size = file_size - data_start
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in entries.items():
        try:
            code, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise bad(f"tensor '{name}' has a malformed entry {entry!r}") from None
        if code not in _CODE_TO_DTYPE:
            raise bad(f"tensor '{name}' has unsupported dtype {code!r}")
        if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
        ):
            raise bad(f"tensor '{name}' has an invalid shape {shape!r}")
        if not all(isinstance(o, int) and not isinstance(o, bool) for o in (begin, end)):
            raise bad(f"tensor '{name}' has invalid data offsets {[begin, end]!r}")
        dtype = _CODE_TO_DTYPE[code]
        nbytes = math.prod(shape) * dtype.itemsize
        if not 0 <= begin <= end <= data_size or end - begin != nbytes:
            raise bad(
                f"tensor '{name}' claims bytes [{begin}, {end}) for {nbytes} bytes of "
                f"{code}{shape}, but the data section has {data_size} bytes"
            )
        tensors[name] = TensorInfo(name, dtype, tuple(shape), data_start + begin, nbytes)
        spans.append((begin, end, name))
    spans.sort()
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:], strict=False):
        if b1 < e0:
            raise bad(f"tensors '{n0}' and '{n1}' overlap")
    version = metadata.get("eqx_train.format_version")
    if version is not None and version != str(FORMAT_VERSION):
        raise bad(
            f"it has eqx_train format version {version}; this eqx_train reads version "
            f"{FORMAT_VERSION}"
        )
    return Header(tensors, metadata, path)


# --------------------------------------------------------------------------------------------
# Bytes in and out.


def _as_bytes(array: np.ndarray) -> memoryview:
    flat = np.ascontiguousarray(array).reshape(-1)
    return flat.view(np.uint8).data


def write_all(fd: int, data: memoryview) -> None:
    """Writes every byte of `data` to `fd` (os.write may write fewer bytes than asked)."""
    view = data
    while len(view):
        written = os.write(fd, view[:_WRITE_CHUNK])
        view = view[written:]


def write_tensors(fd: int, tensors: Sequence[TensorLeaf]) -> None:
    """Writes each tensor's bytes in order, fetching one leaf at a time (bounded extra memory)."""
    for t in tensors:
        array = t.get()
        if array.shape != t.shape or np.dtype(array.dtype) != t.dtype:
            raise RuntimeError(
                f"save_checkpoint: leaf '{t.name}' changed from {t.dtype}{list(t.shape)} to "
                f"{array.dtype}{list(array.shape)} while it was being saved."
            )
        write_all(fd, _as_bytes(array))


def read_tensor(fd: int, info: TensorInfo, path: str) -> np.ndarray:
    """Reads one tensor with positioned reads into a fresh array (one copy, no other bytes)."""
    out = np.empty(info.shape, dtype=info.dtype)
    view = _as_bytes(out) if info.nbytes else memoryview(b"")
    done = 0
    while done < info.nbytes:
        count = os.preadv(fd, [view[done:]], info.start + done)
        if count == 0:
            raise CheckpointFormatError(
                f"{path} is not a valid checkpoint: it ended while reading tensor '{info.name}' "
                "(truncated)."
            )
        done += count
    return out
