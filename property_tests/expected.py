"""Expected results stated independently of the code under test, shared by the laws (and
the search budget with which a planted bug must break one, `DEFAULT_BUDGET`)."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, Phase, settings, strategies as st

from eqx_train.testing import strategies as ets

# hypothesis's default budget, searched the same way every run, stopping at the first
# failure: a planted bug must break a law within it.
DEFAULT_BUDGET = settings(
    max_examples=100,
    database=None,
    derandomize=True,
    phases=[Phase.generate],
    # hypothesis's enum metaclass hides from pyright that iterating gives its members
    suppress_health_check=list(HealthCheck),  # pyright: ignore[reportArgumentType]
)

#: The dtypes a JAX array can hold without `jax_enable_x64`: every saved dtype but the
#: 64-bit ones (JAX would turn those into their 32-bit counterparts).
JAX_DTYPES = tuple(d for d in ets.DTYPES if d.itemsize < 8)

#: Dict keys: identifiers, so that dotted names stay unambiguous.
dict_keys = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_0123456789", min_size=1, max_size=6)
dict_keys = dict_keys.filter(lambda k: not k[0].isdigit())


def as_saved(tree: Any) -> Any:
    """What `restore_checkpoint(path, None)` gives back, by the documented rule: Equinox
    modules and namedtuples become dicts of their (non-static) fields in order, functions
    become None, JAX arrays NumPy arrays (typed keys stay keys); the rest as it was."""
    if isinstance(tree, eqx.Module):
        fields = [f.name for f in dataclasses.fields(tree) if not f.metadata.get("static")]
        return {name: as_saved(getattr(tree, name)) for name in fields}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return {
            name: as_saved(value) for name, value in zip(cast(Any, tree)._fields, tree, strict=True)
        }
    if isinstance(tree, dict):
        return {k: as_saved(v) for k, v in tree.items()}
    if type(tree) in (list, tuple):
        return type(tree)(as_saved(v) for v in tree)
    if isinstance(tree, jax.Array) and not jnp.issubdtype(tree.dtype, jax.dtypes.prng_key):
        return np.asarray(tree)
    if callable(tree) and not isinstance(tree, jax.Array):
        return None
    return tree
