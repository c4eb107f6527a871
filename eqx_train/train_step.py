"""`jit_step`: a training step that partitions the state once and donates its buffers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jaxtyping import PyTree

__all__ = ["jit_step"]


def jit_step(
    fn: Callable[..., Any],
    static: PyTree,
    *,
    has_aux: bool = False,
    donate: bool = True,
) -> Callable[..., Any]:
    """Compiles `fn(state, *args)` into a step over the array part of `state` only.

    `eqx.filter_jit` re-partitions the whole state in Python on every call; on a small model
    that costs more than the step itself. Partition once with
    `arrays, static = eqx.partition(state, eqx.is_array)`, then loop over `arrays` with the
    function this returns: each call is one plain `jax.jit` dispatch, and the old buffers are
    donated so the update happens in place.

    **Arguments:**

    - `fn`: `fn(state, *args, **kwargs) -> new_state`, or `-> (new_state, aux)` with
      `has_aux=True`. `state` is the full pytree (e.g. a `TrainState`), rebuilt inside the
      trace from `arrays` and `static`.
    - `static`: the non-array part of the state from `eqx.partition(state, eqx.is_array)`.
    - `has_aux`: whether `fn` also returns auxiliary output (loss, metrics).
    - `donate`: donate the incoming `arrays` (default). Do not reuse an `arrays` after passing
      it in when this is on.

    **Returns:**

    `step(arrays, *args, **kwargs) -> new_arrays` (or `(new_arrays, aux)`). Recombine with
    `eqx.combine(new_arrays, static)` when the full state is needed (to checkpoint or evaluate).

    **Example:**

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, optax
    import eqx_train

    model = eqx.nn.MLP(2, 1, 32, 2, key=jax.random.key(0))
    state = eqx_train.TrainState.create(model=model, tx=optax.adam(1e-3))
    batches = [(jnp.ones((16, 2)), jnp.zeros((16, 1)))] * 3


    def loss_fn(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)


    def train_step(state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(state.model, x, y)
        return state.apply_gradients(grads=grads), loss


    arrays, static = eqx.partition(state, eqx.is_array)
    step = eqx_train.jit_step(train_step, static, has_aux=True)
    for x, y in batches:
        arrays, loss = step(arrays, x, y)
    state = eqx.combine(arrays, static)
    assert int(state.step) == 3
    ```

    Raises `ValueError` at trace time if `fn` changes the non-array part of the state (a new
    activation function, a different optimiser), because the loop could not carry it.
    """
    static_structure = jax.tree.structure(static)

    def traced(arrays: PyTree, *args: Any, **kwargs: Any) -> Any:
        state = eqx.combine(arrays, static)
        out = fn(state, *args, **kwargs)
        new_state, aux = out if has_aux else (out, None)
        new_arrays, new_static = eqx.partition(new_state, eqx.is_array)
        if jax.tree.structure(new_static) != static_structure or not _same_leaves(
            new_static, static
        ):
            raise ValueError(
                "jit_step: the step function changed the non-array part of the state "
                "(static fields, functions, structure); only array leaves can change between "
                "steps. Re-partition and build a new jit_step if the change is intended."
            )
        return (new_arrays, aux) if has_aux else new_arrays

    return jax.jit(traced, donate_argnums=(0,) if donate else ())


def _same_leaves(a: PyTree, b: PyTree) -> bool:
    return all(
        x is y or x == y for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )
