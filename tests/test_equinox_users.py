"""Equinox models through checkpoints: weak types kept, `eqx.nn.State` named by its
markers, typed keys named by implementation, and the manager's messages."""

import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_train.checkpoints import (
    CheckpointManager,
    ConfigMismatchWarning,
    PartialRestoreWarning,
    restore_checkpoint,
    save_checkpoint,
)
from tests.support.helpers import assert_trees_equal


def _norm(**kwargs):
    return eqx.nn.BatchNorm(2, "batch", mode="batch", **kwargs)


class Net(eqx.Module):
    """A bfloat16 BatchNorm before a bfloat16 convolution."""

    norm: eqx.nn.BatchNorm
    conv: eqx.nn.Conv2d

    def __init__(self, key):
        self.norm = _norm(dtype=jnp.bfloat16)
        self.conv = eqx.nn.Conv2d(2, 2, 1, key=key, dtype=jnp.bfloat16)

    def __call__(self, x, state):
        x, state = self.norm(x, state)
        return self.conv(x), state


def _trained_net():
    """A `Net` and its state after one training batch (the counter is 1, weakly typed)."""
    model, state = eqx.nn.make_with_state(Net)(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (4, 2, 3, 3), jnp.bfloat16)
    batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    _, state = batched(x, state)
    return model, state, x


def _counter(state):
    return state.get(eqx.nn.make_with_state(Net)(jax.random.key(0))[0].norm.batch_counter)


# ------------------------------------------------------------------------------ weak types


def test_restore_into_a_target_keeps_the_weak_type_of_batchnorms_counter(tmp_path):
    _, state, _ = _trained_net()
    assert _counter(state).weak_type
    save_checkpoint(tmp_path, state, 1)
    restored = restore_checkpoint(tmp_path, state)
    assert _counter(restored).weak_type and _counter(restored).dtype == jnp.int32
    assert int(_counter(restored)) == 1


def test_a_jitted_function_does_not_retrace_for_a_restored_state(tmp_path):
    _, state, _ = _trained_net()
    traces = []

    @jax.jit
    def total(state):
        traces.append(None)
        return sum(jnp.sum(leaf) for leaf in jax.tree.leaves(state))

    total(state)
    save_checkpoint(tmp_path, state, 1)
    total(restore_checkpoint(tmp_path, state))
    assert len(traces) == 1


def test_target_none_gives_back_a_weakly_typed_array(tmp_path):
    save_checkpoint(tmp_path, {"weak": jnp.asarray(3), "strong": jnp.int32(3)}, 1)
    restored = restore_checkpoint(tmp_path, None)
    assert isinstance(restored["weak"], jax.Array) and restored["weak"].weak_type
    assert restored["weak"].dtype == jnp.int32 and int(restored["weak"]) == 3
    assert not getattr(restored["strong"], "weak_type", False)


def test_bfloat16_batchnorm_runs_in_inference_after_a_target_none_round_trip(tmp_path):
    model, state, x = _trained_net()
    inference = eqx.nn.inference_mode(model)
    before, _ = inference(x[0], state)
    save_checkpoint(tmp_path, state, 1)
    saved = restore_checkpoint(tmp_path, None)
    # One BatchNorm: its counter's marker sorts before its statistics', as in the State.
    restored = jax.tree.unflatten(jax.tree.structure(state), jax.tree.leaves(saved))
    after, _ = inference(x[0], restored)
    assert after.dtype == jnp.bfloat16
    assert_trees_equal(after, before)


# ------------------------------------------------------------------------- eqx.nn.State


def _state_of(*names) -> tuple[Any, eqx.nn.State]:
    """A model with a BatchNorm per name (class `Model` either way, as when a stateful
    layer is added to a model's code), and its state with distinct statistics."""
    fields = {name: eqx.nn.BatchNorm for name in names}

    def init(self):
        for name in names:
            setattr(self, name, _norm())

    cls = type("Model", (eqx.Module,), {"__annotations__": fields, "__init__": init})
    model, state = eqx.nn.make_with_state(cls)()
    for i, name in enumerate(names):
        index = getattr(model, name).batch_state_index
        stats = jnp.full(2, 10.0 * (i + 1), jnp.float32)
        state = state.set(index, (stats, stats))
    return model, state


def test_state_entries_are_named_by_their_markers(tmp_path):
    _, state = _state_of("old")
    save_checkpoint(tmp_path, {"bn_state": state}, 1)
    saved = restore_checkpoint(tmp_path, None)["bn_state"]
    assert set(saved) == {"Model.old.batch_counter", "Model.old.batch_state_index"}


def test_a_stateful_layer_inserted_before_is_reported_missing_not_the_old_ones(tmp_path):
    _, state = _state_of("old")
    save_checkpoint(tmp_path, {"bn_state": state}, 1)
    _, grown = _state_of("new", "old")
    with pytest.raises(ValueError) as error:
        restore_checkpoint(tmp_path, {"bn_state": grown})
    message = str(error.value)
    assert "'bn_state.Model.new.batch_state_index.0': missing from the file" in message
    assert "Model.old" not in message


def test_strict_false_keeps_each_layers_statistics_with_its_layer(tmp_path):
    model, state = _state_of("old")
    save_checkpoint(tmp_path, {"bn_state": state}, 1)
    grown_model, grown = _state_of("new", "old")
    # The new layer's entries are the ones the warning names as kept.
    with pytest.warns(PartialRestoreWarning, match=r"Model\.new"):
        restored = restore_checkpoint(tmp_path, {"bn_state": grown}, strict=False)["bn_state"]
    old_mean, _ = restored.get(grown_model.old.batch_state_index)
    new_mean, _ = restored.get(grown_model.new.batch_state_index)
    assert_trees_equal(old_mean, state.get(model.old.batch_state_index)[0])  # 10, saved
    assert_trees_equal(new_mean, grown.get(grown_model.new.batch_state_index)[0])  # kept


def _positional_file(path, state):
    """A file as eqx_train wrote a State before naming entries by marker: by position."""
    counter, (mean, var) = jax.tree.unflatten(
        jax.tree.structure((0, (0, 0))), jax.tree.leaves(state)
    )
    save_checkpoint(path, {"bn_state": {"0": counter, "1": (mean, var)}}, 1)


def test_a_file_naming_state_entries_by_position_still_restores(tmp_path):
    model, state = _state_of("old")
    _positional_file(tmp_path, state)
    _, fresh = _state_of("old")
    restored = restore_checkpoint(tmp_path, {"bn_state": fresh})["bn_state"]
    assert_trees_equal(jax.tree.leaves(restored), jax.tree.leaves(state))


def test_a_positional_file_is_refused_when_the_state_has_more_entries(tmp_path):
    _, state = _state_of("old")
    _positional_file(tmp_path, state)
    _, grown = _state_of("new", "old")
    with pytest.raises(ValueError, match=r"by position .* with 3 tensors there; .* has 6"):
        restore_checkpoint(tmp_path, {"bn_state": grown}, strict=False)


# ---------------------------------------------------------------------------- typed keys


def test_an_rbg_key_restored_into_a_threefry_target_names_both_implementations(tmp_path):
    save_checkpoint(tmp_path, {"key": jax.random.key(0, impl="rbg")}, 1)
    with pytest.raises(ValueError) as error:
        restore_checkpoint(tmp_path, {"key": jax.random.key(0)})
    message = str(error.value)
    assert "'key': file has a rbg PRNG key, target expects threefry2x32" in message
    assert "(4,)" not in message  # not reported as a shape mismatch


# ------------------------------------------------------------------ the manager's messages


def test_restore_best_without_best_metric_says_best_metric_is_needed(tmp_path):
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, {"w": jnp.ones(2)}, metrics={"loss": 0.5})
        with pytest.raises(ValueError, match="step='best'.* needs best_metric"):
            manager.restore({"w": jnp.ones(2)}, step="best")


def test_config_mismatch_warning_points_at_the_callers_line(tmp_path):
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, {"dropout": eqx.nn.Dropout(0.1), "w": np.ones(2)})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            manager.restore({"dropout": eqx.nn.Dropout(0.3), "w": np.ones(2)})
    (warning,) = [w for w in caught if issubclass(w.category, ConfigMismatchWarning)]
    assert warning.filename == __file__
