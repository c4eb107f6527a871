"""Pytree helpers shared by every module: key paths to names, array tests, and the one walk
that finds where two trees differ."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import jax.tree_util as jtu
else:  # imported on first use: the command line reads headers without JAX
    from ._lazy import LazyModule

    eqx = LazyModule("equinox")
    jax = LazyModule("jax")
    jnp = LazyModule("jax.numpy")
    jtu = LazyModule("jax.tree_util")

KeyPath = tuple[Any, ...]


def key_to_str(key: Any) -> str:
    """One key-path entry as it appears in a dotted name (`dense`, `0`, `weight`)."""
    if isinstance(key, jtu.DictKey):
        return str(key.key)
    if isinstance(key, jtu.SequenceKey):
        return str(key.idx)
    if isinstance(key, jtu.GetAttrKey):
        return key.name
    if isinstance(key, jtu.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def path_to_name(path: Sequence[Any]) -> str:
    """A key path joined by dots: `params.dense.kernel`, `opt_state.1.mu`. The root is `<root>`."""
    if len(path) == 0:
        return "<root>"
    return ".".join(key_to_str(k) for k in path)


def is_state(x: Any) -> bool:
    """True for an `eqx.nn.State` (the running statistics of `BatchNorm` and the like)."""
    return isinstance(x, eqx.nn.State)


def state_entries(state: Any) -> list[tuple[Any, Any]]:
    """The entries of an `eqx.nn.State` as `[(key, value)]`, each keyed by its
    `StateIndex` marker (`DictKey('Model.bn.ema_state_index')`).

    JAX flattens a `State` by position (`FlattenedIndexKey(0)`, ...), so inserting a
    stateful layer renumbers every later entry; the markers `eqx.nn.make_with_state` gives
    are the layers' own paths and do not move. Markers that are not unique strings (a
    `State` built some other way) keep the positional keys.
    """
    values, markers = state.tree_flatten()
    named = all(isinstance(m, str) for m in markers) and len(set(markers)) == len(markers)
    keys = [jtu.DictKey(m) if named else jtu.FlattenedIndexKey(i) for i, m in enumerate(markers)]
    return list(zip(keys, values, strict=True))


def flatten_with_names(tree: Any) -> list[tuple[KeyPath, Any]]:
    """`jtu.tree_flatten_with_path(tree)[0]`, in the same order, except that the entries of
    every `eqx.nn.State` are keyed by their markers (`state_entries`): the key paths a
    checkpoint names its tensors by."""
    pairs = []
    for path, leaf in jtu.tree_flatten_with_path(tree, is_leaf=is_state)[0]:
        if not is_state(leaf):
            pairs.append((path, leaf))
            continue
        for key, value in state_entries(leaf):
            pairs += [((*path, key, *sub), x) for sub, x in flatten_with_names(value)]
    return pairs


def is_array(x: Any) -> bool:
    """True for JAX arrays and NumPy arrays/scalars (the leaves we move, save and stack)."""
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def leaves_with_names(
    tree: Any, is_leaf: Callable[[Any], bool] | None = None
) -> tuple[list[tuple[str, Any]], Any]:
    """Flatten `tree` into `(dotted name, leaf)` pairs and its treedef."""
    pairs, treedef = jtu.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(path_to_name(path), leaf) for path, leaf in pairs], treedef


def map_arrays_with_path(fn: Callable[[str, Any], Any], tree: Any) -> Any:
    """Apply `fn(name, leaf)` to every array leaf; every other leaf is returned unchanged."""

    def visit(path: KeyPath, leaf: Any) -> Any:
        return fn(path_to_name(path), leaf) if is_array(leaf) else leaf

    return jtu.tree_map_with_path(visit, tree)


def map_array_leaves_batched(fn: Callable[[list[Any]], list[Any]], tree: Any) -> Any:
    """Replaces all array leaves of `tree` at once with `fn(list_of_array_leaves)`.

    For work that should see every leaf together (one `device_put` for a whole tree);
    non-array leaves are kept.
    """
    leaves, treedef = jtu.tree_flatten(tree)
    positions = [i for i, leaf in enumerate(leaves) if is_array(leaf)]
    for i, new in zip(positions, fn([leaves[i] for i in positions]), strict=True):
        leaves[i] = weak_like(leaves[i], new)  # as `jax.device_put` keeps it
    return jtu.tree_unflatten(treedef, leaves)


def place_like(values: Any, like: Any, *, copy: bool = False) -> Any:
    """`values` (a NumPy or JAX array of `like`'s shape and dtype) placed exactly as the target
    leaf `like` is, so that jitted code cannot tell the two apart: the same sharding, the
    same committedness and the same weak type.

    - `like` committed (placed with a device or sharding, or the output of a computation on
      committed arrays), or a `jax.ShapeDtypeStruct` with a sharding: committed to that
      sharding.
    - `like` uncommitted (`jnp.zeros(())`, `jnp.asarray(x)`, anything made without a device
      or sharding): uncommitted on its device, as `jnp.asarray` would have made it. A
      committed copy would refuse to meet arrays on other devices in one `jit` ("incompatible
      devices") and make jitted functions compile again.
    - `like` without a sharding (a `ShapeDtypeStruct` without one): uncommitted on the
      default device, as `jnp.asarray` places it.

    Not for NumPy targets (they stay NumPy) nor arrays over several processes (read block
    by block). With `copy`, a `jax.Array` `values` already placed so is copied, not returned.
    """
    alias = False if copy else None
    sharding = getattr(like, "sharding", None)
    if sharding is not None and isinstance(like, jax.Array) and not like.committed:
        (device,) = sharding.device_set  # an uncommitted array lives on one device
        # Without a device, `device_put` places on the default device, uncommitted; the
        # weak type's conversion must run there too (it would go to the default device).
        with jax.default_device(device):
            return weak_like(like, jax.device_put(values, may_alias=alias))
    placed = jax.device_put(values, sharding, may_alias=alias)
    return weak_like(like, placed)


def weak_like(leaf: Any, restored: Any) -> Any:
    """`restored` with the weak type of the target `leaf`: a `jax.Array` made from a Python
    number (`eqx.nn.BatchNorm`'s batch counter, `jnp.array(0)`) is weakly typed, and a
    strongly typed copy would promote what it meets (`momentum ** counter` turning bfloat16
    into float32) and retrace every jitted function it is passed to."""
    if getattr(leaf, "weak_type", False) and isinstance(restored, jax.Array):
        return as_weak(restored)
    return restored


def as_weak(array: Any) -> Any:
    """`array` (a `jax.Array`) weakly typed, with its dtype, values and sharding. JAX has no
    public call for this; its `jax.numpy` functions use the one below."""
    try:
        from jax._src.lax import lax as _lax  # no public equivalent (JAX 0.4.16 to 0.10)

        return _lax._convert_element_type(array, array.dtype, weak_type=True)
    except (ImportError, AttributeError, TypeError):  # a JAX that moved it: the public way
        if array.ndim != 0:
            return array
        weak = jax.device_put(jnp.asarray(array.item()), array.sharding)  # a Python number
        return weak if weak.dtype == array.dtype else array


Children = Callable[[Any], "list[tuple[Any, Any]] | None"]
"""One level of a tree: `[(key, child)]` for a node, None for a leaf."""


def differences(
    a: Any,
    b: Any,
    *,
    children: Children,
    node_difference: Callable[[Any, Any, list, list, KeyPath], str | None],
    leaf_difference: Callable[[Any, Any, KeyPath], str | None],
) -> Iterator[tuple[KeyPath, str, Any, Any]]:
    """Walks two trees together, depth first in the order `children` gives, and yields
    `(key path, what differs, a's side, b's side)` at each place where they differ.

    Where either side is a leaf (`children` gives None), `leaf_difference(x, y, path)` says
    how the pair differs, or None. Where both are nodes, `node_difference(x, y, x's
    children, y's children, path)` says how they differ in themselves (type, keys, static
    fields), or None, and then their children are walked pair by pair; nothing below a
    pair that differs is compared. The callers say what a node is and word each
    difference: this is the one walk behind every "where do two trees differ" of
    eqx_train (`assert_trees_equal`, and `jit_step`'s check of a state's static part).

    **Arguments:**

    - `a`, `b`: the two trees.
    - `children`: one level of either tree.
    - `node_difference`: how two nodes differ in themselves; None when their children line
      up (same keys, in the same order), which must hold for them to be walked.
    - `leaf_difference`: how a pair with a leaf on at least one side differs.

    **Returns:**

    An iterator over the differences, first difference first.
    """

    def visit(x: Any, y: Any, path: KeyPath) -> Iterator[tuple[KeyPath, str, Any, Any]]:
        pairs_x, pairs_y = children(x), children(y)
        if pairs_x is None or pairs_y is None:
            what = leaf_difference(x, y, path)
        else:
            what = node_difference(x, y, pairs_x, pairs_y, path)
            if what is None:
                for (key, child_x), (_, child_y) in zip(pairs_x, pairs_y, strict=True):
                    yield from visit(child_x, child_y, (*path, key))
                return
        if what is not None:
            yield path, what, x, y

    return visit(a, b, ())
