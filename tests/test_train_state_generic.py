"""`TrainState[M]`: a state parametrised by its model's type works at run time as the bare
class does (the parameter is for type checkers; the pytree is unchanged)."""

from typing import Generic, TypeVar

import equinox as eqx
import jax
import optax
from jaxtyping import PRNGKeyArray

from eqx_train import TrainState

M = TypeVar("M")
TX = optax.sgd(0.1)


class KeyedState(TrainState[M], Generic[M]):
    key: PRNGKeyArray


def _model() -> eqx.nn.Linear:
    return eqx.nn.Linear(2, 2, key=jax.random.key(0))


def test_parametrised_create_returns_the_bare_class():
    state = TrainState[eqx.nn.Linear].create(model=_model(), tx=TX)
    assert type(state) is TrainState


def test_parametrised_state_has_the_bare_state_structure():
    model = _model()
    bare = TrainState.create(model=model, tx=TX)
    typed = TrainState[eqx.nn.Linear].create(model=model, tx=TX)
    assert jax.tree.structure(typed) == jax.tree.structure(bare)


def test_generic_subclass_creates_updates_and_jits():
    model = _model()
    state = KeyedState[eqx.nn.Linear].create(model=model, tx=TX, key=jax.random.key(1))
    grads = jax.tree.map(jax.numpy.ones_like, eqx.filter(model, eqx.is_array))
    step = eqx.filter_jit(lambda s, g: s.apply_gradients(grads=g))
    state = step(step(state, grads), grads)
    assert type(state) is KeyedState and int(state.step) == 2
    assert jax.numpy.allclose(state.model.weight, model.weight - 0.2)


def test_generic_subclass_flattens_and_rebuilds():
    state = KeyedState.create(model=_model(), tx=TX, key=jax.random.key(1))
    leaves, treedef = jax.tree.flatten(state)
    assert eqx.tree_equal(jax.tree.unflatten(treedef, leaves), state)
