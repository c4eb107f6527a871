"""TrainState: an `opt_state` that `tx` did not make is named as such whatever
error the optimiser's update raises on it."""

from __future__ import annotations

import jax.numpy as jnp
import optax
import pytest

from eqx_train import TrainState


def test_a_tx_replaced_without_its_opt_state_is_named_not_an_attribute_error():
    state = TrainState.create(model={"w": jnp.ones(2)}, tx=optax.adam(0.1))
    momentum = state.replace(tx=optax.sgd(0.1, momentum=0.9))  # still Adam's opt_state
    expected = r"is not what `tx` makes .*`tx` or `trainable` was replaced"
    with pytest.raises(ValueError, match=expected):
        momentum.apply_gradients(grads={"w": jnp.ones(2)})


def test_trainable_replaced_without_its_opt_state_is_named():
    state = TrainState.create(model={"a": jnp.ones(2), "b": jnp.ones(2)}, tx=optax.adam(0.1))
    narrower = state.replace(trainable={"a": True, "b": False})  # Adam's state still has 'b'
    with pytest.raises(ValueError, match=r"it has \['opt_state.0.mu.b'.*`trainable` was replaced"):
        narrower.apply_gradients(grads={"a": jnp.ones(2), "b": jnp.ones(2)})
