"""PyTorch-style state dicts: dotted names to arrays, and back into a pytree.

Names are the ones eqx_train's checkpoint files use (`eqx_train._tree.flatten_with_names`:
key paths joined by dots, an `eqx.nn.State`'s entries named by their `StateIndex` markers),
which are PyTorch's `state_dict` names wherever an Equinox module and its `torch.nn`
counterpart name their fields alike.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, overload

import equinox as eqx
import jax
import jax.tree_util as jtu
import ml_dtypes
import numpy as np

from .._tree import flatten_with_names, is_state, path_to_name, place_like
from ..checkpoints.engine import call, calling, is_prng_key, place_key, short

_T = TypeVar("_T")
KeyMap = Mapping[str, str | None] | Callable[[str], str | None]


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What `from_state_dict(..., strict=False)` could not load.

    **Fields:**

    - `missing`: target names of weights that the state dict has no entry for (those
      leaves keep the target's values).
    - `unexpected`: state dict names (as given, before `key_map`) that name no target leaf
      (ignored).
    - `mismatched`: target names whose state dict entry has another shape or dtype (those
      leaves keep the target's values).
    - `kept_keys`: target names of typed PRNG keys that the state dict has no entry for:
      those keys are the target's own, not loaded ones. A PyTorch state dict holds no keys;
      to load one, give its key data (`jax.random.key_data`) under this name.

    Each is a sorted tuple of names; all four are empty when everything loaded.
    """

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[str, ...] = ()
    kept_keys: tuple[str, ...] = ()


def _is_key(leaf: Any) -> bool:
    """A typed PRNG key, concrete or abstract (a `ShapeDtypeStruct` of a key dtype)."""
    return is_prng_key(leaf) or (
        isinstance(leaf, jax.ShapeDtypeStruct)
        and jax.numpy.issubdtype(leaf.dtype, jax.dtypes.prng_key)
    )


def _is_weight(leaf: Any) -> bool:
    # Typed PRNG keys are state, not weights; Python scalars are configuration.
    return isinstance(leaf, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct) and not (
        _is_key(leaf)
    )


@dataclasses.dataclass(frozen=True)
class _Leaves:
    """A tree's leaves (in `jtu.tree_flatten` order) with their names: `names` as checkpoint
    files give them (State entries by marker), `positional` as JAX's key paths do."""

    leaves: list[Any]
    treedef: Any
    names: list[str]
    positional: list[str]

    def loadable(self) -> list[int]:
        """Indices of the weights and typed keys: the leaves a state dict can fill."""
        return [i for i, leaf in enumerate(self.leaves) if _is_weight(leaf) or _is_key(leaf)]


def _leaves(tree: Any) -> _Leaves:
    """The leaves of `tree` with their names; refuses two loadable leaves of one name."""
    pairs, treedef = jtu.tree_flatten_with_path(tree)
    named = [path_to_name(path) for path, _ in flatten_with_names(tree)]
    found = _Leaves(
        [leaf for _, leaf in pairs], treedef, named, [path_to_name(p) for p, _ in pairs]
    )
    seen: set[str] = set()
    for i in found.loadable():
        name = named[i]
        if name in seen:
            raise ValueError(
                f"{call()}: two leaves of the tree have the name '{name}' (a key contains '.' "
                "or keys differ only in type, e.g. 1 and '1'). Rename the keys."
            )
        seen.add(name)
    return found


def _conv_bias_names(tree: Any) -> set[str]:
    """Names of the biases of `eqx.nn.Conv` layers: Equinox stores them as (out, 1, ..., 1)
    so that they broadcast; PyTorch as (out,)."""
    pairs, _ = jtu.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, eqx.nn.Conv))
    return {
        path_to_name((*path, jtu.GetAttrKey("bias")))
        for path, node in pairs
        if isinstance(node, eqx.nn.Conv) and node.bias is not None
    }


def to_state_dict(tree: Any) -> dict[str, np.ndarray]:
    """The array leaves of `tree` as a flat dict from dotted names to NumPy arrays.

    The names are those of eqx_train's checkpoint files, `plan_restore` and
    `eqx-train inspect` (`layers.0.weight`, `params.dense.kernel`); the entries of an
    `eqx.nn.State` are named by their `StateIndex` markers, the layers' own paths
    (`bn_state.CNN.bn.batch_counter`), not by position, so that adding a stateful layer
    renames no other layer's statistics. For Equinox modules whose layout agrees with
    PyTorch's, they are the `state_dict` keys of the equivalent `torch.nn` modules, so
    `torch_module.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})` works:

    | Equinox | PyTorch | entries |
    |---|---|---|
    | `eqx.nn.Linear` | `nn.Linear` | `weight` (out, in), `bias` (out,) |
    | `eqx.nn.Conv1d/2d/3d` | `nn.Conv1d/2d/3d` | `weight` (out, in/groups, *k), `bias` (out,) |
    | `eqx.nn.LayerNorm` | `nn.LayerNorm` | `weight`, `bias` (normalized shape) |
    | `eqx.nn.Embedding` | `nn.Embedding` | `weight` (num, dim) |

    Equinox stores a convolution's bias as (out, 1, ..., 1); it is exported as (out,), as
    PyTorch has it, and `from_state_dict` accepts either. Containers differ in name where
    their fields do (`eqx.nn.Sequential` is `layers.0...`, `nn.Sequential` is `0...`):
    rename with `from_state_dict`'s `key_map`.

    Only weights are exported: JAX and NumPy arrays and NumPy scalars (as 0-d arrays).
    `None`, static fields, functions, Python scalars (configuration such as a dropout rate)
    and typed PRNG keys (`jax.random.key`) are left out.

    **Arguments:**

    - `tree`: any pytree (an Equinox module, a TrainState, nested dicts).

    **Returns:**

    A dict from names to fresh NumPy arrays (copies: mutating them does not change `tree`),
    in the tree's flattening order. bfloat16 arrays keep ml_dtypes' `bfloat16` dtype.
    """
    with calling("to_state_dict"):
        found = _leaves(tree)
    conv_biases = _conv_bias_names(tree)
    out: dict[str, np.ndarray] = {}
    for i, leaf in enumerate(found.leaves):
        if not _is_weight(leaf):
            continue
        name = found.names[i]
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise TypeError(f"to_state_dict: leaf '{name}' is a ShapeDtypeStruct, with no data.")
        array = np.array(leaf, copy=True)
        if name in conv_biases:
            array = array.reshape(-1)
        out[name] = array
    return out


def _is_torch_tensor(value: Any) -> bool:
    # By name, so that torch is never imported for NumPy input.
    return any(c.__module__ == "torch" and c.__name__ == "Tensor" for c in type(value).__mro__)


# torch's one-byte float formats that ml_dtypes shares (same names, same bits).
_FLOAT8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")


def _torch_to_numpy(tensor: Any) -> np.ndarray:
    import torch  # pyright: ignore[reportMissingImports]  # only reached for a torch tensor

    tensor = tensor.detach().cpu().resolve_conj().resolve_neg()
    # NumPy has no bfloat16/float8: reinterpret the bits (a view, no copy) as ml_dtypes'.
    reinterpret = {
        torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
        **{
            getattr(torch, name): (torch.uint8, getattr(ml_dtypes, name))
            for name in _FLOAT8
            if hasattr(torch, name) and hasattr(ml_dtypes, name)
        },
    }
    if tensor.dtype in reinterpret:
        bits, dtype = reinterpret[tensor.dtype]
        return tensor.view(bits).numpy().view(dtype)
    return tensor.numpy()


def _as_numpy(name: str, value: Any) -> np.ndarray:
    if is_prng_key(value):  # a typed key given for a typed key: its data
        return np.asarray(jax.random.key_data(value))
    if isinstance(value, np.ndarray | np.generic | jax.Array):
        return np.asarray(value)
    if _is_torch_tensor(value):
        try:
            return _torch_to_numpy(value)
        except (TypeError, RuntimeError, NotImplementedError) as error:  # sparse, meta, complex32
            raise TypeError(
                f"from_state_dict: state dict entry '{name}' ({value.dtype}, layout "
                f"{value.layout}, device {value.device}) has no NumPy equivalent: {error}"
            ) from None
    raise TypeError(
        f"from_state_dict: state dict entry '{name}' is a {type(value).__name__}; expected a "
        "NumPy array, a JAX array or a torch.Tensor."
    )


def _same_layout(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    # Shapes that differ only in size-1 axes hold the same elements in the same order
    # (an Equinox conv bias (out, 1, 1) and PyTorch's (out,)).
    return a == b or (
        math.prod(a) == math.prod(b) and [d for d in a if d != 1] == [d for d in b if d != 1]
    )


def _renamed(
    state_dict: Mapping[str, Any], key_map: KeyMap | None
) -> tuple[dict[str, str], list[str]]:
    """{target name: state dict name} after `key_map`, and the dropped state dict names."""
    by_target: dict[str, str] = {}
    dropped: list[str] = []
    for source in state_dict:
        if not isinstance(source, str):
            raise TypeError(
                f"from_state_dict: state dict key {short(source)} is a {type(source).__name__}; "
                "keys must be str."
            )
        if key_map is None:
            target_name: str | None = source
        elif callable(key_map):
            target_name = key_map(source)
        else:
            target_name = key_map.get(source, source)
        if target_name is None:
            dropped.append(source)
            continue
        if not isinstance(target_name, str):
            raise TypeError(
                f"from_state_dict: key_map maps '{source}' to {short(target_name)}; expected a "
                "str (or None to drop the entry)."
            )
        if target_name in by_target:
            raise ValueError(
                f"from_state_dict: key_map maps both '{by_target[target_name]}' and '{source}' "
                f"to '{target_name}'."
            )
        by_target[target_name] = source
    return by_target, dropped


def _describe(array: Any) -> str:
    return f"{np.dtype(array.dtype)}{list(array.shape)}"


def _expected(leaf: Any) -> Any:
    """What a state dict entry for `leaf` holds: the leaf, or a typed key's data (uint32
    `(*shape, 2)` for threefry), as a shape and dtype."""
    return jax.eval_shape(jax.random.key_data, leaf) if _is_key(leaf) else leaf


def _fill(leaf: Any, value: np.ndarray) -> Any:
    value = np.array(value.reshape(_expected(leaf).shape), copy=True)  # never alias the caller's
    if _is_key(leaf):
        return place_key(value, leaf)  # the target's implementation, placed as it is
    if isinstance(leaf, np.ndarray):
        return value
    if isinstance(leaf, np.generic):
        return value[()]
    return place_like(value, leaf)


def _state_spans(tree: Any) -> list[tuple[str, str, range]]:
    """(name, name prefix, leaf indices) of every `eqx.nn.State` in `tree`."""
    spans = []
    start = 0
    for path, node in jtu.tree_flatten_with_path(tree, is_leaf=is_state)[0]:
        count = len(jtu.tree_leaves(node)) if is_state(node) else 1
        if is_state(node):
            prefix = f"{path_to_name(path)}." if path else ""
            spans.append((path_to_name(path), prefix, range(start, start + count)))
        start += count
    return spans


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")


def _lookup_names(tree: Any, found: _Leaves, available: Mapping[str, str]) -> list[str]:
    """The name each leaf of `tree` is looked up by in `available`: its own name, except in
    an `eqx.nn.State` that `available` names only by position (`bn_state.1.0`, as
    `to_state_dict` did before it named State entries by their `StateIndex` markers), whose
    entries are then matched by position, provided their number is the State's."""
    names = list(found.names)
    loadable = set(found.loadable())
    for state_name, prefix, span in _state_spans(tree):
        indices = [i for i in span if i in loadable]
        if any(names[i] in available for i in indices):
            continue
        if not any(found.positional[i] in available for i in indices):
            continue  # in neither form: missing
        given = sorted(name for name in available if name.startswith(prefix))
        if len(given) != len(indices):
            raise ValueError(
                f"{call()}: the state dict names the entries of the eqx.nn.State at "
                f"'{state_name}' by position ({_some(given)}), as to_state_dict did before "
                f"it named them by their StateIndex markers; the target's State has "
                f"{len(indices)} entries ({_some([names[i] for i in indices])}), not "
                f"{len(given)}: a stateful layer was added or removed, so the entries cannot "
                "be matched to the layers by position. Rename them to the target's names "
                "with key_map=."
            )
        for i in indices:
            names[i] = found.positional[i]
    return names


@overload
def from_state_dict(
    target: _T,
    state_dict: Mapping[str, Any],
    *,
    key_map: KeyMap | None = None,
    strict: Literal[True] = True,
) -> _T: ...


@overload
def from_state_dict(
    target: _T,
    state_dict: Mapping[str, Any],
    *,
    key_map: KeyMap | None = None,
    strict: Literal[False],
) -> tuple[_T, LoadReport]: ...


@overload
def from_state_dict(
    target: _T,
    state_dict: Mapping[str, Any],
    *,
    key_map: KeyMap | None = None,
    strict: bool,
) -> _T | tuple[_T, LoadReport]: ...


def from_state_dict(
    target: Any,
    state_dict: Mapping[str, Any],
    *,
    key_map: KeyMap | None = None,
    strict: bool = True,
) -> Any:
    """`target` with its weights replaced by the entries of `state_dict`.

    Every weight leaf of `target` (as `to_state_dict` names them) is looked up in
    `state_dict` by name (after `key_map`). Values may be NumPy arrays, JAX arrays or,
    where PyTorch is installed, `torch.Tensor`s of any dtype NumPy or ml_dtypes has
    (bfloat16 and float8 included); tensors are converted through their buffers, never
    through Python lists, and torch is not imported unless a value is a tensor.

    Each loaded leaf keeps the target leaf's type (a JAX array stays a JAX array on the
    target's sharding; a `jax.ShapeDtypeStruct`, as from `eqx.filter_eval_shape`, becomes a
    JAX array) and is a copy: it never shares memory with the state dict's tensors.
    Dtypes must match exactly (no silent casts: cast the state dict first); shapes must match
    up to size-1 axes, so PyTorch's (out,) convolution bias loads into Equinox's
    (out, 1, 1). A loaded leaf is weakly typed where the target's is (`eqx.nn.BatchNorm`'s
    counter), so a jitted step taking the loaded tree does not compile again.

    The entries of an `eqx.nn.State` are named by their `StateIndex` markers
    (`bn_state.CNN.bn.batch_counter`), as `to_state_dict` and checkpoint files name them.
    State dicts from versions that named them by position (`bn_state.0`, `bn_state.1.0`)
    still load, by position, while the State has as many entries as the state dict holds
    there; otherwise they are refused, naming the new names.

    A typed PRNG key (`jax.random.key`) loads from its key data (`jax.random.key_data`:
    uint32 `(*shape, 2)` for the default threefry implementation) or from a key array, and
    keeps the target key's implementation. A key the state dict has no entry for keeps the
    target's key, in either mode, since PyTorch state dicts hold none; with `strict=False`
    the report lists it under `kept_keys`. Python scalars and static fields always keep the
    target's values.

    **Arguments:**

    - `target`: the pytree to fill (an Equinox model, or a template of one).
    - `state_dict`: a mapping from names to arrays, such as PyTorch's `module.state_dict()`.
    - `key_map`: renames state dict entries to target names: a dict (names it lacks stay as
      they are) or a function; a name mapped to `None` is dropped. For example
      `lambda k: "layers." + k` turns `nn.Sequential`'s `0.weight` into
      `eqx.nn.Sequential`'s `layers.0.weight`.
    - `strict`: with `True`, anything missing, unexpected or mismatched raises one
      `ValueError` listing every such name; with `False`, whatever fits is loaded and a
      `LoadReport` says what did not.

    **Returns:**

    The filled tree if `strict`, else `(tree, report)`.
    """
    with calling("from_state_dict"):
        found = _leaves(target)
        by_target, _ = _renamed(state_dict, key_map)
        names = _lookup_names(target, found, by_target)
    missing: list[str] = []
    kept_keys: list[str] = []
    mismatched: list[str] = []
    problems: list[str] = []
    loaded: dict[int, np.ndarray] = {}
    for i in found.loadable():
        name, leaf = found.names[i], found.leaves[i]
        source = by_target.pop(names[i], None)
        if source is None:
            (kept_keys if _is_key(leaf) else missing).append(name)
            continue
        value = _as_numpy(source, state_dict[source])
        expected = _expected(leaf)
        shape = tuple(int(d) for d in expected.shape)
        if np.dtype(value.dtype) != np.dtype(expected.dtype) or not _same_layout(
            value.shape, shape
        ):
            mismatched.append(name)
            renamed = "" if source == name else f" (from state dict entry '{source}')"
            what = " (the data of a typed PRNG key)" if _is_key(leaf) else ""
            problems.append(
                f"  '{name}'{renamed}: the state dict has {_describe(value)}, the target "
                f"{_describe(expected)}{what}"
            )
            continue
        loaded[i] = value
    unexpected = sorted(by_target.values())
    if strict and (missing or unexpected or mismatched):
        lines = ["from_state_dict: the state dict does not fit the target."]
        if missing:
            lines.append(f"Missing (in the target, not in the state dict): {', '.join(missing)}")
        if unexpected:
            lines.append(
                f"Unexpected (in the state dict, not in the target): {', '.join(unexpected)}"
            )
        if mismatched:
            lines.append("Mismatched shape or dtype:")
            lines.extend(problems)
        lines.append(
            "Rename entries with key_map=, cast dtypes before loading, or pass strict=False "
            "to load what fits and get a LoadReport."
        )
        raise ValueError("\n".join(lines))
    new_leaves = list(found.leaves)
    for i, value in loaded.items():
        new_leaves[i] = _fill(found.leaves[i], value)
    tree = jtu.tree_unflatten(found.treedef, new_leaves)
    if strict:
        return tree
    report = LoadReport(
        tuple(sorted(missing)), tuple(unexpected), tuple(sorted(mismatched)), tuple(kept_keys)
    )
    return tree, report
