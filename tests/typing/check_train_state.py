"""Checked by pyright in CI (not run by pytest): `TrainState`'s constructors and updates
return the subclass they are called on, so a subclass's fields stay typed."""

import equinox as eqx
import jax
import optax
from jaxtyping import PRNGKeyArray

from eqx_train import TrainState


class KeyedState(TrainState):
    key: PRNGKeyArray


def _keyed_state() -> KeyedState:
    model = eqx.nn.Linear(2, 2, key=jax.random.key(0))
    state: KeyedState = KeyedState.create(model=model, tx=optax.sgd(0.1), key=jax.random.key(1))
    state = state.replace(key=jax.random.split(state.key)[0])
    grads = jax.tree.map(jax.numpy.zeros_like, eqx.filter(state.model, eqx.is_array))
    state = state.apply_gradients(grads=grads, key=jax.random.fold_in(state.key, 1))
    return state
