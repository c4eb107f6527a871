"""The `pytrees` strategy: random nests of containers, Equinox modules and leaves."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from hypothesis import strategies as st

from ._array_strategies import Draw, arrays

__all__ = ["Pair", "RandomModule", "pytrees"]

#: Dict keys: short identifiers, so that dotted checkpoint names stay unambiguous.
_DICT_KEYS = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_0123456789", min_size=1, max_size=6)
_DICT_KEYS = _DICT_KEYS.filter(lambda k: not k[0].isdigit())
_ACTIVATIONS = (jax.nn.relu, jax.nn.gelu, jnp.tanh)


class Pair(NamedTuple):
    """The namedtuple node that `pytrees` draws."""

    first: Any
    second: Any


class RandomModule(eqx.Module):
    """The Equinox module that `pytrees` draws: an array field, a subtree, a function, Python
    configuration (`scale`, `training`, saved and restored as configuration) and a static
    field (`label`, part of the tree's structure)."""

    weight: Any
    children: Any
    activation: Callable = jax.nn.relu
    scale: float = 1.0
    training: bool = True
    label: str = eqx.field(static=True, default="layer")


_NODE_KINDS = ("dict", "list", "tuple", "namedtuple", "module")


def pytrees(
    leaves: st.SearchStrategy | None = None,
    *,
    max_leaves: int = 8,
    max_depth: int = 3,
) -> st.SearchStrategy[Any]:
    """Random pytrees: nested dicts (identifier keys), lists, tuples, namedtuples (`Pair`),
    `None` and Equinox modules (`RandomModule`: an array field, a subtree, an activation
    function, Python-scalar configuration and a static field), with empty containers too.

    Shrinks towards a single leaf, then towards fewer and shallower nodes (dicts first),
    and each leaf as `leaves` shrinks.

    **Arguments:**

    - `leaves`: the strategy for leaves; default `arrays()` (NumPy arrays of every saved
      dtype). For example `st.one_of(arrays(), keys())` mixes in typed keys, and
      `arrays().map(jnp.asarray)` gives JAX arrays.
    - `max_leaves`: at most this many leaves drawn from `leaves` or `None` (a module's
      function and configuration come besides); a tree stops growing when they are used
      up. At least 1.
    - `max_depth`: at most this many nested nodes above any leaf.

    **Returns:**

    A strategy of pytrees.
    """
    if max_leaves < 1 or max_depth < 0:
        raise ValueError(
            f"pytrees: max_leaves={max_leaves} must be >= 1 and max_depth={max_depth} >= 0."
        )
    leaf = arrays() if leaves is None else leaves
    return _pytrees(leaf, max_leaves, max_depth)


@st.composite
def _pytrees(draw: Draw, leaf: st.SearchStrategy, max_leaves: int, max_depth: int) -> Any:
    def node(depth: int, cap: int) -> tuple[Any, int]:
        """A subtree with at most `cap` (>= 1) leaves, and how many it has."""
        # A leaf when out of depth or room, or when the (shrinking) coin says so.
        if depth >= max_depth or cap <= 1 or not draw(st.booleans()):
            return draw(st.one_of(leaf, st.none())), 1
        kind = draw(st.sampled_from(_NODE_KINDS))
        if kind == "module":
            children, used = node(depth + 1, cap - 1)
            module = RandomModule(
                weight=draw(st.one_of(leaf, st.none())),
                children=children,
                activation=draw(st.sampled_from(_ACTIVATIONS)),
                scale=draw(st.floats(-1e3, 1e3, allow_nan=False, width=32)),
                training=draw(st.booleans()),
                label=draw(st.sampled_from(["dense", "conv", "head"])),
            )
            return module, used + 1
        size = 2 if kind == "namedtuple" else draw(st.integers(0, min(3, cap)))
        children, room = [], cap
        for i in range(size):
            child, used = node(depth + 1, room - (size - i - 1))  # room for the others
            children.append(child)
            room -= used
        if kind == "namedtuple":
            return Pair(*children), cap - room
        if kind == "dict":
            names = draw(st.lists(_DICT_KEYS, min_size=size, max_size=size, unique=True))
            return dict(zip(names, children, strict=True)), cap - room
        return (children if kind == "list" else tuple(children)), cap - room

    return node(0, max_leaves)[0]
