"""A restore that would fill none of the target's leaves (no saved name in common with
them) is an error whatever `strict` says, naming the file, some saved names and some target
names; a target with nothing to restore (no data leaves, or a filter selecting none) is not
such a case."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints import CheckpointManager, plan_restore, restore_checkpoint
from tests.support.helpers import assert_trees_equal

SAVED = {"encoder": {"weight": np.ones((2, 3), np.float32), "bias": np.zeros(2, np.float32)}}


@pytest.fixture
def directory(tmp_path):
    checkpoints.save_checkpoint(tmp_path, SAVED, 1)
    return tmp_path


def _renamed_target():
    return {"backbone": {"weight": jnp.zeros((2, 3)), "bias": jnp.zeros(2)}}


@pytest.mark.parametrize("strict", [True, False])
def test_a_restore_that_fills_no_leaf_is_refused_whatever_strict_says(directory, strict):
    with pytest.raises(ValueError) as caught:
        restore_checkpoint(directory, _renamed_target(), strict=strict)
    message = str(caught.value)
    assert "checkpoint_1.safetensors does not match the target" in message
    assert "none of the target's 2 leaves to restore is in the file" in message
    assert "the file holds 2 tensors ('encoder.bias', 'encoder.weight')" in message
    assert "the target asks for 'backbone.bias', 'backbone.weight'" in message
    assert "rename=" in message and "plan_restore" in message
    assert "strict=False" not in message  # it would not help


def test_the_plan_of_a_restore_that_fills_no_leaf_says_so_first(directory):
    plan = plan_restore(directory, _renamed_target(), strict=False)
    assert not plan.ok
    assert plan.problems[0].startswith("none of the target's 2 leaves to restore")


def test_the_manager_refuses_a_restore_that_fills_no_leaf(tmp_path):
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, SAVED)
        with pytest.raises(ValueError, match="none of the target's 2 leaves"):
            manager.restore(_renamed_target(), strict=False)


def test_an_abstract_target_that_fills_no_leaf_is_refused(directory):
    target = jax.eval_shape(_renamed_target)
    with pytest.raises(ValueError, match="none of the target's 2 leaves"):
        restore_checkpoint(directory, target, strict=False)


def test_one_leaf_in_common_is_a_partial_restore_not_an_error(directory):
    target = {"encoder": {"weight": jnp.zeros((2, 3))}, "head": jnp.zeros(4)}
    with pytest.warns(checkpoints.PartialRestoreWarning):
        restored = restore_checkpoint(directory, target, strict=False)
    assert_trees_equal(restored["encoder"]["weight"], SAVED["encoder"]["weight"])


def test_a_target_without_data_leaves_is_not_refused(directory):
    target = {"activation": jax.nn.relu, "dropout": eqx.nn.Dropout(0.1)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", checkpoints.PartialRestoreWarning)  # unused tensors
        restored = restore_checkpoint(directory, target, strict=False)
    assert restored["activation"] is jax.nn.relu


def test_a_filter_selecting_no_leaf_is_not_refused_and_expects_every_tensor_unused(directory):
    target = _renamed_target()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restored = restore_checkpoint(directory, target, filter_spec=False)
    assert_trees_equal(restored, target)
