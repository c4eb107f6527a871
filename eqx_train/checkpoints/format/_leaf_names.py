"""The tensor name each leaf of a restore target is looked up by.

A leaf's name is its key path joined by dots (`model.layers.0.weight`), except inside an
`eqx.nn.State`, whose entries are named by their `StateIndex` markers
(`bn_state.Model.blocks[0].norm.ema_state_index.0`) rather than by position. Files written
before that named State entries by position (`bn_state.1.0`); those still restore, by
position, but only while the State has as many tensors as the file holds there: a stateful
layer added or removed since would move one layer's statistics into another.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jax.tree_util as jtu
else:
    from ..._lazy import LazyModule

    jtu = LazyModule("jax.tree_util")

from ..._calls import call
from ..._tree import flatten_with_names, is_state, path_to_name


def leaf_names(target: Any, available: Mapping[str, Any], path: str) -> list[str]:
    """The tensor name of every leaf of `target`, in `jtu.tree_flatten` order, for the file at
    `path` whose tensors are `available` (by name).

    **Raises:**

    `ValueError` when the file names a State's entries by position and holds another
    number of tensors there than the target's State has.
    """
    positional = [path_to_name(p) for p, _ in jtu.tree_flatten_with_path(target)[0]]
    named = [path_to_name(p) for p, _ in flatten_with_names(target)]
    if named == positional:
        return named
    names = list(named)
    start = 0
    for state_path, leaf in jtu.tree_flatten_with_path(target, is_leaf=is_state)[0]:
        count = len(jtu.tree_leaves(leaf)) if is_state(leaf) else 1
        span = range(start, start + count)
        start += count
        if not is_state(leaf) or any(named[i] in available for i in span):
            continue
        if not any(positional[i] in available for i in span):
            continue  # in neither form: reported as missing by the matcher
        prefix = f"{path_to_name(state_path)}." if state_path else ""
        saved = sum(1 for name in available if name.startswith(prefix))
        if saved != count:
            raise ValueError(
                f"{call()}: {path} stores the eqx.nn.State at '{path_to_name(state_path)}' "
                f"by position (written before eqx_train named State entries by their "
                f"StateIndex markers), with {saved} tensors there; the target's State has "
                f"{count}. A stateful layer was added or removed, so the saved statistics "
                "cannot be matched to the target's layers. Restore into the model the file "
                "was saved from (and save again to name the entries), or pass target=None "
                "to load the file as saved."
            )
        for i in span:
            names[i] = positional[i]
    return names
