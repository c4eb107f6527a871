"""jit_step: partition once, donate, same result as an eager loop, one compilation."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

from eqx_train import TrainState, jit_step
from tests.helpers import tree_allclose

TX = optax.adam(1e-2)


def _state():
    model = eqx.nn.MLP(3, 2, 16, 2, activation=jax.nn.gelu, key=jax.random.key(0))
    return TrainState.create(model=model, tx=TX)


def _train_step(state, x):
    def loss_fn(model):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(state.model)
    return state.apply_gradients(grads=grads), loss


def test_jit_step_matches_eager_apply_gradients():
    xs = [jax.random.normal(jax.random.key(i), (8, 3)) for i in range(5)]
    eager = _state()
    for x in xs:
        eager, _ = _train_step(eager, x)
    arrays, static = eqx.partition(_state(), eqx.is_array)
    step = jit_step(_train_step, static, has_aux=True)
    losses = []
    for x in xs:
        arrays, loss = step(arrays, x)
        losses.append(float(loss))
    state = eqx.combine(arrays, static)
    assert int(state.step) == 5
    assert state.model.activation is jax.nn.gelu
    assert tree_allclose(state, eager, rtol=1e-5, atol=1e-7)
    assert losses[-1] < losses[0]


def test_jit_step_compiles_once():
    traces = []

    def counted(state, x):
        traces.append(1)
        return _train_step(state, x)[0]

    arrays, static = eqx.partition(_state(), eqx.is_array)
    step = jit_step(counted, static)
    for i in range(6):
        arrays = step(arrays, jnp.full((8, 3), float(i)))
    assert len(traces) == 1


def test_jit_step_donates_incoming_arrays():
    arrays, static = eqx.partition(_state(), eqx.is_array)
    step = jit_step(lambda s, x: _train_step(s, x)[0], static)
    old = arrays
    arrays = step(arrays, jnp.ones((8, 3)))
    with pytest.raises(RuntimeError, match="deleted"):
        jnp.sum(old.model.layers[0].weight).block_until_ready()


def test_jit_step_rejects_changing_static_part():
    arrays, static = eqx.partition(_state(), eqx.is_array)

    def swaps_activation(state, x):
        return eqx.tree_at(lambda s: s.model.activation, state, jax.nn.relu)

    with pytest.raises(ValueError, match="changed the non-array part"):
        jit_step(swaps_activation, static, donate=False)(arrays, jnp.ones((8, 3)))
