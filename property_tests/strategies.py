"""Shared hypothesis strategies: random arrays (all dtypes, zero-size shapes) and pytrees.

Later property tests (checkpoints, jax_utils) draw from these, so every law is checked on the
same awkward inputs: bfloat16, bool, int8, empty arrays, None leaves, tuples vs lists, and
Equinox modules that hold functions and static fields next to arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

#: Every dtype the project promises to handle, as NumPy dtypes (bfloat16 from ml_dtypes).
ALL_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(d)
    for d in (
        jnp.bfloat16,
        np.float16,
        np.float32,
        np.bool_,
        np.int8,
        np.int16,
        np.int32,
        np.uint8,
        np.uint16,
        np.uint32,
    )
)
FLOAT_DTYPES: tuple[np.dtype, ...] = tuple(
    d for d in ALL_DTYPES if d.kind == "f" or d.name == "bfloat16"
)

#: Dict keys: identifiers, so that dotted names stay unambiguous.
keys = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_0123456789", min_size=1, max_size=6).filter(
    lambda k: not k[0].isdigit()
)


def shapes(*, max_dims: int = 3, max_side: int = 4, allow_empty: bool = True) -> st.SearchStrategy:
    """Array shapes of rank 0..max_dims; sides from 0 (zero-size) when `allow_empty`."""
    return hnp.array_shapes(
        min_dims=0, max_dims=max_dims, min_side=0 if allow_empty else 1, max_side=max_side
    )


@st.composite
def arrays(
    draw: st.DrawFn,
    dtypes: Sequence[np.dtype] = ALL_DTYPES,
    shape: st.SearchStrategy | tuple[int, ...] | None = None,
) -> np.ndarray:
    """A NumPy array of a random dtype from `dtypes` and a random (possibly zero-size) shape.

    Floats include infinities and NaN; bfloat16 is drawn as float32 and cast.
    """
    dtype = draw(st.sampled_from(list(dtypes)))
    shape_ = (
        draw(shapes()) if shape is None else (shape if isinstance(shape, tuple) else draw(shape))
    )
    if dtype.name == "bfloat16":
        base = draw(hnp.arrays(np.float32, shape_, elements=st.floats(width=32)))
        return base.astype(dtype)
    if dtype.kind == "f":
        return draw(hnp.arrays(dtype, shape_, elements=st.floats(width=dtype.itemsize * 8)))
    return draw(hnp.arrays(dtype, shape_))


class RandomModule(eqx.Module):
    """An Equinox module mixing arrays with non-array leaves (a function, a static string)."""

    weight: Any
    children: Any
    activation: Callable = jax.nn.relu
    label: str = eqx.field(static=True, default="layer")


ACTIVATIONS = (jax.nn.relu, jax.nn.gelu, jnp.tanh)


def pytrees(
    leaves: st.SearchStrategy | None = None,
    *,
    max_leaves: int = 8,
    modules: bool = True,
) -> st.SearchStrategy:
    """Random nested pytrees of dicts, lists, tuples, None and (optionally) RandomModules."""
    leaf_strategy = arrays() if leaves is None else leaves

    def extend(children: st.SearchStrategy) -> st.SearchStrategy:
        options = [
            st.dictionaries(keys, children, min_size=1, max_size=3),
            st.lists(children, min_size=1, max_size=3),
            st.lists(children, min_size=1, max_size=3).map(tuple),
        ]
        if modules:
            options.append(
                st.builds(
                    RandomModule,
                    weight=leaf_strategy,
                    children=children,
                    activation=st.sampled_from(ACTIVATIONS),
                    label=st.sampled_from(["dense", "conv", "head"]),
                )
            )
        return st.one_of(*options)

    return st.recursive(
        st.one_of(leaf_strategy, st.none()) if modules else leaf_strategy,
        extend,
        max_leaves=max_leaves,
    )


def array_leaves(tree: Any) -> list[Any]:
    """The array leaves of a tree, in flattening order."""
    return [x for x in jax.tree.leaves(tree) if isinstance(x, np.ndarray | jax.Array)]
