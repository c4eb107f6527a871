"""Hypothesis strategies for JAX and Equinox training code.

Every strategy shrinks towards small trees and simple dtypes (float32 first), and is an
ordinary `hypothesis` strategy: it composes with `st.builds`, `.map`, `st.one_of` and
`st.data()`.

```python
import jax.numpy as jnp
from hypothesis import given, settings, strategies as st
from eqx_train.testing import strategies as ets

@settings(max_examples=5, deadline=None)
@given(tree=ets.pytrees(st.one_of(ets.arrays(), ets.keys()), max_leaves=4))
def test_flatten_unflatten(tree):
    import jax
    leaves, treedef = jax.tree.flatten(tree)
    assert jax.tree.structure(jax.tree.unflatten(treedef, leaves)) == treedef

test_flatten_unflatten()
```
"""

from ._array_strategies import DTYPES as DTYPES, arrays as arrays, keys as keys, shapes as shapes
from ._model_strategies import modules as modules, train_states as train_states
from ._tree_strategies import Pair as Pair, RandomModule as RandomModule, pytrees as pytrees

__all__ = [
    "DTYPES",
    "Pair",
    "RandomModule",
    "arrays",
    "keys",
    "modules",
    "pytrees",
    "shapes",
    "train_states",
]
