"""Saving a state whose buffers were donated to a jitted step (or deleted) fails before
anything is written, naming the leaf and the cause, on every save path: sync, async
(`AsyncManager`, `CheckpointManager(async_save=True)`) and the `.shards` layout."""

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqx_train
from eqx_train import checkpoints
from eqx_train.checkpoints import AsyncManager, CheckpointManager

DONATED = r"leaf '{}' is a jax\.Array whose buffer has been deleted: it was donated"


def _save_sync(directory, state):
    checkpoints.save_checkpoint(directory, state, 1)


def _save_async(directory, state):
    manager = AsyncManager()
    try:
        checkpoints.save_checkpoint(directory, state, 1, async_manager=manager)
    finally:
        manager.wait_previous_save()


def _save_with_an_async_manager(directory, state):
    with CheckpointManager(directory, async_save=True, handle_sigterm=False) as manager:
        manager.save(1, state)


def _save_shards(directory, state):
    checkpoints.save_checkpoint_multiprocess(directory, state, 1)


SAVERS = [_save_sync, _save_async, _save_with_an_async_manager, _save_shards]


@pytest.mark.parametrize("save", SAVERS, ids=lambda f: f.__name__)
def test_saving_a_deleted_array_names_the_leaf_and_writes_nothing(tmp_path, save):
    state = {"params": {"w": jnp.ones(2), "b": jnp.zeros(2)}}
    state["params"]["w"].delete()
    with pytest.raises(RuntimeError, match=DONATED.format("params.w")):
        save(tmp_path, state)
    assert checkpoints.available_steps(tmp_path) == []
    assert not [name for name in os.listdir(tmp_path) if "checkpoint" in name]


@pytest.mark.parametrize("save", [_save_sync, _save_async], ids=lambda f: f.__name__)
def test_saving_a_state_donated_to_a_jit_step_names_the_leaf(tmp_path, save):
    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    state = eqx_train.TrainState.create(model=model, tx=optax.sgd(0.1))
    arrays, static = eqx.partition(state, eqx.is_array)

    def train_step(state, x):
        grads = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x)))(state.model)
        return state.apply_gradients(grads=grads)

    step = eqx_train.jit_step(train_step, static)
    new_arrays = step(arrays, jnp.ones((4, 2)))
    stale = eqx.combine(arrays, static)  # the state passed in: its buffers were donated
    with pytest.raises(RuntimeError, match=DONATED.format("step")):
        save(tmp_path, stale)
    save(tmp_path, eqx.combine(new_arrays, static))  # the returned state saves fine
    assert checkpoints.available_steps(tmp_path) == [1]


def test_saving_a_donated_typed_key_names_the_leaf(tmp_path):
    key = jax.random.key(0)
    jax.jit(lambda k: jax.random.split(k)[0], donate_argnums=0)(key)
    assert key.is_deleted()
    with pytest.raises(RuntimeError, match=DONATED.format("rng")):
        checkpoints.save_checkpoint(tmp_path, {"rng": key}, 1)
