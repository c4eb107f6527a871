# pyright: strict
"""A strictly typed user of eqx_train, checked by pyright in strict mode (CI runs pyright on
tests/typing; tests/test_typing_strict.py keeps the strict comment above in place).

It uses the public API as a researcher writing strictly typed JAX does: every call must
resolve to known types, and `assert_type` pins what a call returns (the model's type kept
through `create`, `apply_gradients`, `replace` and `jit_step`; the target's type through a
restore). Importing it runs nothing; its functions run in tests/test_typing_strict.py.
"""

from __future__ import annotations

from typing import Any, assert_type

import equinox as eqx
import jax
import numpy as np
import optax  # pyright: ignore[reportMissingTypeStubs]  (optax ships no py.typed)
from hypothesis import strategies as st
from jax.sharding import Mesh
from jaxtyping import Array, Float, PRNGKeyArray

from eqx_train import (
    DynamicScale,
    EarlyStopping,
    TrainState,
    fsdp_sharding,
    jit_step,
    replicate,
    shard_to_mesh,
    unreplicate,
)
from eqx_train.checkpoints import CheckpointManager, restore_checkpoint, save_checkpoint
from eqx_train.testing import assert_checkpoint_roundtrip, assert_trees_equal, strategies as ets

from .typed_equinox import combine, filter_grad, filter_value_and_grad, partition


class KeyedState(TrainState[eqx.nn.MLP]):
    """A subclass fixing the model type and adding a field."""

    key: PRNGKeyArray


Batch = dict[str, np.ndarray[Any, np.dtype[np.float32]]]


def loss_fn(model: eqx.nn.MLP, x: Float[Array, "b 2"], y: Float[Array, "b 2"]) -> Array:
    predictions = jax.vmap(model)(x)
    return ((predictions - y) ** 2).mean()


def data(size: int) -> tuple[Float[Array, "b 2"], Float[Array, "b 2"]]:
    x = jax.random.normal(jax.random.key(size), (size, 2))
    return x, -x


def make_state() -> TrainState[eqx.nn.MLP]:
    model = eqx.nn.MLP(2, 2, 8, 1, key=jax.random.key(0))
    state = TrainState.create(model=model, tx=optax.adam(1e-3))
    assert_type(state, TrainState[eqx.nn.MLP])
    assert_type(state.model, eqx.nn.MLP)
    return state


def train_step(
    state: TrainState[eqx.nn.MLP], x: Float[Array, "b 2"], y: Float[Array, "b 2"]
) -> tuple[TrainState[eqx.nn.MLP], Array]:
    loss, grads = filter_value_and_grad(loss_fn)(state.model, x, y)
    new_state = state.apply_gradients(grads=grads)
    assert_type(new_state, TrainState[eqx.nn.MLP])
    return new_state, loss


def subclass_keeps_its_type() -> KeyedState:
    model = eqx.nn.MLP(2, 2, 8, 1, key=jax.random.key(0))
    state = KeyedState.create(model=model, tx=optax.sgd(0.1), key=jax.random.key(1))
    assert_type(state, KeyedState)
    state = state.replace(key=jax.random.split(state.key)[0])
    assert_type(state, KeyedState)
    grads = filter_grad(loss_fn)(state.model, *data(4))
    state = state.apply_gradients(grads=grads)
    assert_type(state, KeyedState)
    assert_type(state.model, eqx.nn.MLP)
    return state


def jitted_training(steps: int) -> TrainState[eqx.nn.MLP]:
    state = make_state()
    arrays, static = partition(state)
    step = jit_step(train_step, static, has_aux=True)
    x, y = data(16)
    for _ in range(steps):
        arrays, loss = step(arrays, x, y)
        assert_type(loss, Array)
    return combine(arrays, static)


def mesh_placement(mesh: Mesh) -> None:
    batch: Batch = {"x": np.ones((16, 2), np.float32), "y": np.zeros((16, 2), np.float32)}
    placed = shard_to_mesh(batch, mesh, pad=True)
    assert_type(placed, Batch)
    state = make_state()
    shardings = fsdp_sharding(state, mesh, axis=mesh.axis_names[0])
    assert_type(shardings, TrainState[eqx.nn.MLP])
    replicated = replicate(batch)
    one = unreplicate(replicated)
    assert_type(one, Batch)


def checkpoints(directory: str) -> TrainState[eqx.nn.MLP]:
    state = make_state()
    path: str = save_checkpoint(directory, state, step=1)
    restored = restore_checkpoint(path, state)
    assert_type(restored, TrainState[eqx.nn.MLP])
    as_saved = restore_checkpoint(path, None)
    assert_type(as_saved, Any)
    with CheckpointManager(directory + "/managed", keep_latest=2) as manager:
        manager.save(1, state, metrics={"loss": 0.5})
        again = manager.restore(state)
        assert_type(again, TrainState[eqx.nn.MLP])
        manager.wait()
        saved_tree = manager.restore(None)
        assert_type(saved_tree, Any)
    return restored


def early_stopping_and_scaling(losses: list[float]) -> bool:
    stopper = EarlyStopping(patience=2)
    for loss in losses:
        stopper = stopper.update(loss)
        assert_type(stopper, EarlyStopping)
    scaler = DynamicScale()
    state = make_state()
    x, y = data(4)
    scaler, is_finite, loss, grads = scaler.value_and_grad(loss_fn)(state.model, x, y)
    assert_type(scaler, DynamicScale)
    assert_type(is_finite, Array)
    del loss, grads
    return bool(stopper.should_stop)


def strategies() -> None:
    arrays: st.SearchStrategy[np.ndarray[Any, Any]] = ets.arrays()
    keys: st.SearchStrategy[Array] = ets.keys()
    shapes: st.SearchStrategy[tuple[int, ...]] = ets.shapes()
    trees = ets.pytrees(st.one_of(ets.arrays(), ets.keys()), max_leaves=4)
    modules = ets.modules()
    states = ets.train_states()
    del arrays, keys, shapes, trees, modules, states


def roundtrip_law(directory: str) -> None:
    state = make_state()
    restored = assert_checkpoint_roundtrip(state, directory)
    assert_type(restored, TrainState[eqx.nn.MLP])
    assert_trees_equal(restored, state)


def kernel_as_laid_out(name: str, saved: np.ndarray[Any, Any]) -> np.ndarray[Any, Any] | None:
    """A function transform (here a reshape to the saved tensor's own shape, for kernels)."""
    return saved.reshape(saved.shape) if name.endswith("weight") else None


def fine_tune(directory: str) -> TrainState[eqx.nn.MLP]:
    """`transform=` in both of its forms, as a fine-tuner passes it to every restore call."""
    state = make_state()
    path: str = save_checkpoint(directory, state, step=1)
    flipped = restore_checkpoint(path, state, transform=kernel_as_laid_out)
    assert_type(flipped, TrainState[eqx.nn.MLP])
    kept = restore_checkpoint(path, state, transform={"opt_state": lambda a: a})
    assert_type(kept, TrainState[eqx.nn.MLP])
    as_saved = restore_checkpoint(path, None, transform=None)
    assert_type(as_saved, Any)
    return kept
