"""Restoring a `TrainState` whose optimiser changed since the save: Adam's moments carried
into `chain(clip, adam)` by `rename`, and a fresh optimiser state through a `filter_spec`
that leaves `opt_state` out, which then expects the saved optimiser tensors to go unused
(only those under what it leaves out whole) instead of refusing them."""

import warnings
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from eqx_train import TrainState, checkpoints
from eqx_train.checkpoints import plan_restore, restore_checkpoint
from tests.support.helpers import assert_trees_equal


def _trained(tx, steps=2):
    """A state of a small MLP after `steps` updates, so that the moments are not zeros."""
    state = TrainState.create(model=eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0)), tx=tx)
    for _ in range(steps):
        grads = jax.tree.map(
            lambda x: jnp.ones_like(x) if eqx.is_inexact_array(x) else x, state.model
        )
        state = state.apply_gradients(grads=eqx.filter(grads, eqx.is_inexact_array))
    return state


def _chained():
    model = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(1))
    return TrainState.create(
        model=model, tx=optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    )


def _no_opt_state(state):
    """A filter_spec selecting everything but `opt_state`."""
    spec = jax.tree.map(lambda _: True, state)
    return eqx.tree_at(lambda s: s.opt_state, spec, False)


@pytest.fixture
def adam_checkpoint(tmp_path):
    saved = _trained(optax.adam(1e-3))
    checkpoints.save_checkpoint(tmp_path, saved, 1)
    return tmp_path, saved


def test_adam_moments_carry_into_a_chain_by_renaming_opt_state(adam_checkpoint):
    directory, saved = adam_checkpoint
    plan = plan_restore(directory, _chained(), rename={"opt_state.1": "opt_state"})
    assert plan.ok and plan.taken["opt_state.1.0.mu.layers.0.weight"] == (
        "opt_state.0.mu.layers.0.weight"
    )
    restored = restore_checkpoint(directory, _chained(), rename={"opt_state.1": "opt_state"})
    assert_trees_equal(cast(Any, restored.opt_state)[1][0], cast(Any, saved.opt_state)[0])
    assert_trees_equal(restored.model, saved.model)


def test_a_filter_leaving_out_opt_state_expects_the_saved_optimiser_tensors_unused(
    adam_checkpoint,
):
    directory, saved = adam_checkpoint
    target = _chained()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no PartialRestoreWarning either
        restored = restore_checkpoint(directory, target, filter_spec=_no_opt_state(target))
    assert_trees_equal(restored.model, saved.model)
    assert_trees_equal(restored.step, saved.step)
    assert_trees_equal(restored.opt_state, target.opt_state)  # the fresh state


def test_the_plan_lists_no_saved_optimiser_tensor_as_unused_or_a_problem(adam_checkpoint):
    directory, _ = adam_checkpoint
    target = _chained()
    plan = plan_restore(directory, target, filter_spec=_no_opt_state(target))
    assert plan.ok
    assert plan.unused == []
    assert all(name.startswith("opt_state.") for name in plan.kept)


def test_a_saved_tensor_outside_what_the_filter_leaves_out_is_still_refused(tmp_path):
    saved = _trained(optax.adam(1e-3))
    checkpoints.save_checkpoint(tmp_path, {"state": saved, "extra": np.zeros(3)}, 1)
    target = _chained()
    with pytest.raises(ValueError) as caught:
        restore_checkpoint(
            tmp_path, {"state": target}, filter_spec={"state": _no_opt_state(target)}
        )
    message = str(caught.value)
    assert "'extra': in the file as (3,) float64, not in the target" in message
    assert "opt_state" not in message


def test_a_filter_leaving_out_part_of_a_subtree_expects_only_what_is_under_that_part(
    adam_checkpoint,
):
    # The filter leaves out the chain's Adam moments `mu` only: the saved `opt_state.0.*`
    # are under no sub-tree of the target it leaves out, so they are still unused tensors.
    directory, _ = adam_checkpoint
    target = _chained()
    spec = jax.tree.map(lambda _: True, target)
    spec = eqx.tree_at(lambda s: s.opt_state[1][0].mu, spec, replace_fn=lambda mu: False)
    plan = plan_restore(directory, target, filter_spec=spec, strict=False)
    assert "opt_state.0.mu.layers.0.weight" in plan.unused


def test_a_left_out_subtree_renamed_as_a_whole_expects_its_saved_name_unused(tmp_path):
    ones = np.ones(4, np.float32)
    saved = {"old": {"opt": {"a": ones[:2], "b": ones[:3]}}, "w": ones}
    checkpoints.save_checkpoint(tmp_path, saved, 1)
    target = {"new": {"opt": {"c": jnp.zeros(5)}}, "w": jnp.zeros(4)}
    restored = restore_checkpoint(
        tmp_path, target, rename={"new": "old"}, filter_spec={"new": False, "w": True}
    )
    assert_trees_equal(restored["w"], ones)
