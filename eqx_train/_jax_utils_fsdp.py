"""`fsdp_sharding`: shardings that split each array of a pytree along its largest divisible
dimension over one mesh axis (FSDP style)."""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.tree_util as jtu
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._tree import is_array

# A pytree's type, kept by functions that return a pytree of the same structure (the
# Equinox convention: `eqx.filter` returns the model's type with leaves replaced).
T = TypeVar("T")


def _fsdp_spec(shape: tuple[int, ...], axis: str, size: int) -> PartitionSpec:
    """Shards the largest dimension that `size` divides (the first of equals); none: `P()`."""
    candidates = [(d, -i) for i, d in enumerate(shape) if d >= size and d % size == 0]
    if not candidates:
        return PartitionSpec()
    _, neg_index = max(candidates)
    spec: list[str | None] = [None] * len(shape)
    spec[-neg_index] = axis
    return PartitionSpec(*spec)


def fsdp_sharding(tree: T, mesh: Mesh, axis: str = "model") -> T:
    """Returns FSDP-style shardings for `tree`: each array split along one dimension over `axis`.

    Every array leaf gets a `NamedSharding(mesh, spec)` that splits its largest dimension
    divisible by the size of mesh axis `axis` over that axis (the first such dimension when
    several are equally large) and replicates it over the other mesh axes. A leaf with no
    such dimension (a scalar step count, a bias shorter than the axis) is replicated:
    `PartitionSpec()`. Non-array leaves get `None`.

    The result is a pytree of the same structure as `tree`, so it can be handed to
    `eqx.filter_shard` (outside `jit`: place the state; inside: constrain it) or used as
    `out_shardings`. The usual one-liner shards a whole `TrainState` (model and optimiser
    state alike, since Adam's moments have the parameters' shapes):

    ```python
    import equinox as eqx, jax, numpy as np, optax
    import eqx_train

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    model = eqx.nn.MLP(16, 4, 32, 2, key=jax.random.key(0))
    state = eqx_train.TrainState.create(model=model, tx=optax.adam(1e-3))
    state = eqx.filter_shard(state, eqx_train.fsdp_sharding(state, mesh, "model"))
    ```

    **Arguments:**

    - `tree`: any pytree; array leaves may be `jax.Array`, NumPy arrays or
      `jax.ShapeDtypeStruct`s (e.g. from `eqx.filter_eval_shape`, to build a restore target
      or to initialise a model that does not fit on one device).
    - `mesh`: the device mesh.
    - `axis`: the mesh axis to split parameters over (default `"model"`).

    **Returns:**

    A pytree like `tree` with a `jax.sharding.NamedSharding` at every array leaf and `None`
    at every other leaf.

    **Raises:**

    `ValueError` when `axis` is not an axis of `mesh`.
    """
    if axis not in mesh.axis_names:
        raise ValueError(
            f"fsdp_sharding: axis {axis!r} is not an axis of the mesh; its axes are "
            f"{tuple(mesh.axis_names)}."
        )
    size = int(mesh.shape[axis])

    def one(leaf: Any) -> NamedSharding | None:
        if not (is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)):
            return None
        return NamedSharding(mesh, _fsdp_spec(tuple(leaf.shape), axis, size))

    return jtu.tree_map(one, tree)
