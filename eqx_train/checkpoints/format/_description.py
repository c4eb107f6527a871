"""The tree description: what a pytree becomes in a checkpoint, without the bytes.

`describe` turns a pytree into a JSON description (dicts, lists, tuples, other pytree
nodes as named children, strings kept, non-data leaves skipped) and the `Tensor`s to write;
`validate_description` checks a description read from a file before it is trusted;
`rebuild` turns it back into a tree of NumPy arrays. The leaf kinds and dtypes are
`_leaf_kinds`' (re-exported here).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import jax
    import jax.tree_util as jtu
else:  # imported on first use: the command line reads headers without JAX
    from ..._lazy import LazyModule

    jax = LazyModule("jax")
    jtu = LazyModule("jax.tree_util")

from ..._calls import call
from ..._text import short
from ..._tree import is_state, path_to_name, state_entries
from .._errors import CheckpointFormatError, invalid
from ._json import parse_json as parse_json
from ._keys import RESERVED_TENSOR_NAMES, TREE_KEY
from ._leaf_kinds import (
    CODE_TO_DTYPE as CODE_TO_DTYPE,
    DTYPE_TO_CODE as DTYPE_TO_CODE,
    KIND_BY_NAME as KIND_BY_NAME,
    LEAF_KINDS as LEAF_KINDS,
    MAX_DEPTH as MAX_DEPTH,
    Arrays as Arrays,
    LeafKind as LeafKind,
    Tensor as Tensor,
    dtype_code as dtype_code,
    is_prng_key as is_prng_key,
    key_impl as key_impl,
    kind_of as kind_of,
)

# --------------------------------------------------------------------------------------------
# Tree description: pytree <-> JSON.


def _children(node: Any) -> list[tuple[Any, Any]] | None:
    """One level of flattening as [(key, child)]; None when `node` is a leaf. Empty
    containers ({}, [], an optax EmptyState) are nodes with no children, not leaves. An
    `eqx.nn.State`'s entries are keyed by their `StateIndex` markers, not by position."""
    if is_state(node):
        return state_entries(node)
    pairs, treedef = jtu.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return None
    return [(path[0], child) for path, child in pairs]


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _add_tensor(
    keys: tuple[Any, ...],
    kind: LeafKind,
    leaf: Any,
    tensors: list[Tensor],
    seen: set[str],
    allow_global: bool,
) -> dict[str, Any]:
    """Appends the `Tensor` of data leaf `leaf` at `keys` to `tensors` (`seen`: the tensor
    names so far) and returns its entry in the description; raises, naming the leaf, for
    what cannot be saved faithfully."""
    name = path_to_name(keys)
    if name in RESERVED_TENSOR_NAMES:
        raise ValueError(
            f"{call()}: the tensor name '{name}' is reserved by the safetensors format "
            "(it holds the file's metadata). Rename that key."
        )
    if not name.isascii() and not _is_utf8(name):
        raise ValueError(
            f"{call()}: the tensor name {name!r} is not valid UTF-8 (a key holds a lone "
            "surrogate, e.g. a file name decoded with errors='surrogateescape'); a "
            "safetensors header is UTF-8 JSON. Rename that key."
        )
    if name in seen:
        raise ValueError(
            f"{call()}: two leaves map to the tensor name '{name}' (a key contains '.' "
            "or keys differ only in type, e.g. 1 and '1'). Rename the keys."
        )
    seen.add(name)
    if kind.name == "int" and not -(2**63) <= leaf < 2**63:
        raise OverflowError(
            f"{call()}: leaf '{name}' is the int {short(leaf)}, which does not fit in int64."
        )
    if isinstance(leaf, jax.Array) and leaf.is_deleted():
        # Every save path (sync, async, multi-process) describes its tree first: one
        # check, before anything is written or snapshotted.
        raise RuntimeError(
            f"{call()}: leaf '{name}' is a jax.Array whose buffer has been deleted: it "
            "was donated to a jitted function (a jit_step or pmap_step, or jax.jit with "
            "donate_argnums) or deleted. Save the state that function returned, not "
            "the one passed to it."
        )
    data = kind.data(leaf)
    if not allow_global and isinstance(data, jax.Array) and not data.is_fully_addressable:
        raise ValueError(
            f"{call()}: leaf '{name}' is a jax.Array spread over several processes (not "
            "fully addressable), so no single process can write it. In a multi-process "
            "job use save_checkpoint_multiprocess, called on every process."
        )
    dtype_code(data.dtype, name)
    if isinstance(data, jax.ShapeDtypeStruct):
        raise TypeError(f"{call()}: leaf '{name}' is a ShapeDtypeStruct, which holds no data.")
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
    if getattr(data, "weak_type", False):
        entry["weak_type"] = True
    return entry


def describe(tree: Any, *, allow_global: bool = False) -> tuple[Any, list[Tensor]]:
    """The JSON description of `tree` and its tensors in order. Raises, before anything is
    written, naming the leaf path, for what cannot be saved faithfully."""
    state = _Described(allow_global)
    return _visit(tree, (), state), state.tensors


@dataclass
class _Described:
    """What one `describe` gathers as it walks the tree. A plain object passed down, not a
    closure over a recursive inner function: that would be a reference cycle holding every
    leaf being saved until the garbage collector next ran."""

    allow_global: bool
    tensors: list[Tensor] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)


def _visit(node: Any, keys: tuple[Any, ...], state: _Described) -> Any:
    if len(keys) > MAX_DEPTH:
        raise ValueError(
            f"{call()}: the tree is nested more than {MAX_DEPTH} levels deep at "
            f"'{path_to_name(keys)}'."
        )
    if node is None:
        return None
    if isinstance(node, np.ma.MaskedArray) or (
        isinstance(node, numbers.Number)
        and not isinstance(node, np.generic | int | float | complex)
    ):
        raise TypeError(
            f"{call()}: leaf '{path_to_name(keys)}' is a {type(node).__name__}, which cannot "
            "be saved faithfully (Decimal, Fraction and masked arrays are refused rather "
            "than dropped); convert it to an array of a supported dtype."
        )
    kind = kind_of(node)
    if kind is not None:
        return _add_tensor(keys, kind, node, state.tensors, state.seen, state.allow_global)
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
                    f"{call()}: dict at '{path_to_name(keys)}' has key {short(raw)} of type "
                    f"{type(raw).__name__}; only str and int keys can be saved."
                )
            entries.append(
                [
                    str.__str__(raw) if isinstance(raw, str) else int(raw),
                    _visit(child, (*keys, key), state),
                ]
            )
        return {"dict": entries}
    if type(node) in (list, tuple):
        return {type(node).__name__: [_visit(child, (*keys, key), state) for key, child in pairs]}
    # Any other pytree node (Equinox module, namedtuple, dataclass): named children.
    return {
        "node": type(node).__qualname__,
        "children": [[path_to_name((k,)), _visit(c, (*keys, k), state)] for k, c in pairs],
    }


def parse_description(text: str, arrays: Arrays, bad: Callable[[str], Exception]) -> Any:
    """The tree description `text` read from a checkpoint whose tensors are `arrays`:
    parsed, and validated against those tensors (`validate_description`)."""
    description = parse_json(text, "the tree description", bad)
    validate_description(description, arrays, bad)
    return description


def validate_description(description: Any, arrays: Arrays, bad: Callable[[str], Exception]) -> None:
    """Checks that a description read from a file is well formed and names exactly the
    checkpoint's tensors (`arrays`), each once, with a dtype/shape its kind can hold.
    Iterative: a hostile nesting depth cannot overflow the stack."""
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
            extra = set(node) - {"tensor", "kind", "impl", "weak_type"}
            weak = node.get("weak_type", True) is not True or (
                "weak_type" in node and kind_name != "array"
            )
            if not isinstance(name, str) or kind is None or extra or weak:
                raise bad(f"the tree description has an invalid tensor entry {short(node)}")
            if (kind.name == "prng_key") != isinstance(node.get("impl"), str):
                raise bad(f"the tree description has an invalid tensor entry {short(node)}")
            if name not in arrays:
                raise bad(f"the tree names tensor {short(name)}, which the file lacks")
            if name in named:
                raise bad(f"the tree names tensor {short(name)} twice")
            named.add(name)
            shape, dtype = arrays[name]
            if kind.scalar_type is not None or kind.name == "numpy_scalar":
                wanted = {"bool": "b", "int": "iu", "float": "f", "complex": "c"}.get(
                    kind.name, "biufc"
                )
                if shape != () or (kind.name != "numpy_scalar" and dtype.kind not in wanted):
                    raise bad(
                        f"tensor {short(name)} is a {kind.name} leaf but is stored as "
                        f"{dtype}{list(shape)}"
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
    unnamed = set(arrays) - named
    if unnamed:
        raise bad(f"the file has tensors the tree does not name: {short(sorted(unnamed)[:5])}")


def key_impls(description: Any) -> dict[str, str]:
    """The implementation (`threefry2x32`, `rbg`, ...) of every typed PRNG key a (validated)
    description records, by tensor name."""
    found: dict[str, str] = {}
    stack = [description]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("kind") == "prng_key":
                found[node["tensor"]] = node["impl"]
            else:
                stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found


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


# How a layout of several files (a `.shards` index and its pieces, a Hugging Face index and
# its shards) opens each of them: `_reader.FileReader`, handed down by the layout registry
# (`_layouts`), so that these layouts sit beside the one-file reader rather than above it.
OpenFile = Callable[[str, Any], Any]


class ReaderBase:
    """What every checkpoint reader shares (the file, `.shards` and Hugging Face readers of
    `_layouts.Reader`): the tree description in its metadata, parsed and validated against
    its tensors once, its errors, and use as a context manager."""

    path: str
    metadata: dict[str, str]
    _description: Any = None

    def bad(self, why: str) -> CheckpointFormatError:
        return invalid(self.path)(why)

    def arrays(self) -> Arrays:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def has_description(self) -> bool:
        """False for a checkpoint written by another tool (no tree description)."""
        return TREE_KEY in self.metadata

    def tree_text(self) -> str:
        """The tree description as stored (a reader may check it first)."""
        return self.metadata[TREE_KEY]

    def description(self) -> Any:
        """The tree description, validated against `arrays()` (parsed on the first call)."""
        if self._description is None:
            self._description = parse_description(self.tree_text(), self.arrays(), self.bad)
        return self._description
