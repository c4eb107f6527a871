"""Restore and configuration: the Python scalars of Equinox modules (`Dropout.p`,
`inference`) are the target's configuration; a file that saved other values does not
silently replace them. `filter_spec` saves and restores only the leaves it selects, as in
`eqx.tree_serialise_leaves`. A file saved replicated says so when restored unreplicated."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_train
from eqx_train import checkpoints
from eqx_train.checkpoints import ConfigMismatchWarning
from tests.support.helpers import assert_trees_equal


class Net(eqx.Module):
    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    norm: eqx.nn.BatchNorm

    def __init__(self, p, key):
        self.linear = eqx.nn.Linear(3, 3, key=key)
        self.dropout = eqx.nn.Dropout(p)
        self.norm = eqx.nn.BatchNorm(3, "batch", mode="batch")


def _state(p=0.1, seed=0):
    model = Net(p, jax.random.key(seed))
    return eqx_train.TrainState.create(model=model, tx=optax.adam(1e-3))


def _arrays(tree):
    # Leaves only: two Nets differ in static parts (BatchNorm's state markers, optax's
    # closures) even when built alike.
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def test_restore_keeps_the_targets_dropout_p_and_warns_naming_the_path(tmp_path):
    saved = _state(p=0.1, seed=1)
    checkpoints.save_checkpoint(tmp_path, saved, 1)
    target = _state(p=0.3, seed=2)
    with pytest.warns(ConfigMismatchWarning, match=r"'model\.dropout\.p': saved 0\.1, target 0\.3"):
        restored = checkpoints.restore_checkpoint(tmp_path, target)
    assert restored.model.dropout.p == 0.3
    assert_trees_equal(_arrays(restored), _arrays(saved))  # the weights are the file's


def test_state_saved_in_inference_mode_comes_back_in_training_mode(tmp_path):
    trained = _state(seed=1)
    frozen = trained.replace(model=eqx.nn.inference_mode(trained.model))
    assert frozen.model.dropout.inference and frozen.model.norm.inference
    checkpoints.save_checkpoint(tmp_path, frozen, 1)
    with pytest.warns(ConfigMismatchWarning) as caught:
        restored = checkpoints.restore_checkpoint(tmp_path, _state(seed=2))
    message = str(caught[0].message)
    assert "'model.dropout.inference': saved True, target False" in message
    assert "'model.norm.inference': saved True, target False" in message
    assert restored.model.dropout.inference is False and restored.model.norm.inference is False
    assert_trees_equal(_arrays(restored), _arrays(trained))


def test_config_saved_takes_the_files_configuration(tmp_path):
    frozen = _state(p=0.1, seed=1)
    frozen = frozen.replace(model=eqx.nn.inference_mode(frozen.model))
    checkpoints.save_checkpoint(tmp_path, frozen, 1)
    restored = checkpoints.restore_checkpoint(tmp_path, _state(p=0.3), config="saved")
    assert restored.model.dropout.p == 0.1
    assert restored.model.dropout.inference is True and restored.model.norm.inference is True


def test_equal_configuration_restores_without_a_warning(tmp_path):
    checkpoints.save_checkpoint(tmp_path, _state(p=0.3, seed=1), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restored = checkpoints.restore_checkpoint(tmp_path, _state(p=0.3, seed=2))
    assert_trees_equal(_arrays(restored), _arrays(_state(p=0.3, seed=1)))


def test_the_warning_can_be_made_an_error(tmp_path):
    checkpoints.save_checkpoint(tmp_path, _state(p=0.1), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigMismatchWarning)
        with pytest.raises(ConfigMismatchWarning, match=r"config='saved'"):
            checkpoints.restore_checkpoint(tmp_path, _state(p=0.3))


def test_python_scalars_in_dicts_lists_and_tuples_are_data_and_take_the_saved_value(tmp_path):
    saved = {"epoch": 3, "lr": 0.5, "flags": [True, (7,)]}
    checkpoints.save_checkpoint(tmp_path, saved, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restored = checkpoints.restore_checkpoint(
            tmp_path, {"epoch": -1, "lr": 0.0, "flags": [False, (0,)]}
        )
    assert restored == saved


def test_filter_spec_is_array_saves_no_configuration_and_restores_into_any(tmp_path):
    saved = _state(p=0.1, seed=1)
    checkpoints.save_checkpoint(tmp_path, saved, 1, filter_spec=eqx.is_array)
    as_saved = checkpoints.restore_checkpoint(tmp_path, None)
    assert as_saved["model"]["dropout"] == {"p": None, "inference": None}
    # Nothing to compare: the target's configuration, no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restored = checkpoints.restore_checkpoint(tmp_path, _state(p=0.3, seed=2))
    assert restored.model.dropout.p == 0.3
    assert_trees_equal(_arrays(restored), _arrays(saved))


def test_filter_spec_on_restore_skips_configuration_even_when_saved(tmp_path):
    checkpoints.save_checkpoint(tmp_path, _state(p=0.1, seed=1), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restored = checkpoints.restore_checkpoint(
            tmp_path, _state(p=0.3, seed=2), filter_spec=eqx.is_array
        )
    assert restored.model.dropout.p == 0.3  # strict, yet the saved p is no "extra" tensor
    assert_trees_equal(_arrays(restored), _arrays(_state(seed=1)))


def test_filter_spec_prefix_restores_part_of_a_tree_and_keeps_the_rest(tmp_path):
    saved = {"model": {"w": np.ones(3)}, "opt": {"mu": np.full(3, 2.0)}}
    checkpoints.save_checkpoint(tmp_path, saved, 1)
    target = {"model": {"w": np.zeros(3)}, "opt": {"mu": np.zeros(3)}}
    restored = checkpoints.restore_checkpoint(
        tmp_path, target, filter_spec={"model": True, "opt": False}
    )
    np.testing.assert_array_equal(restored["model"]["w"], np.ones(3))
    assert restored["opt"]["mu"] is target["opt"]["mu"]


def test_filter_spec_prefix_saves_part_of_a_tree(tmp_path):
    tree = {"model": {"w": np.ones(3)}, "opt": {"mu": np.full(3, 2.0)}}
    checkpoints.save_checkpoint(tmp_path, tree, 1, filter_spec={"model": True, "opt": False})
    as_saved = checkpoints.restore_checkpoint(tmp_path, None)
    np.testing.assert_array_equal(as_saved["model"]["w"], np.ones(3))
    assert as_saved["opt"] == {"mu": None}
    with pytest.raises(ValueError, match=r"'opt\.mu': missing from the file"):
        checkpoints.restore_checkpoint(tmp_path, tree)


def test_configuration_missing_from_the_file_is_an_error_only_with_config_saved(tmp_path):
    checkpoints.save_checkpoint(tmp_path, _state(), 1, filter_spec=eqx.is_array)
    with pytest.raises(ValueError, match=r"'model\.dropout\.p': missing from the file"):
        checkpoints.restore_checkpoint(tmp_path, _state(), config="saved")


def test_config_must_be_target_or_saved(tmp_path, without_type_checks):
    checkpoints.save_checkpoint(tmp_path, {"x": np.ones(1)}, 1)
    with pytest.raises(ValueError, match=r"config must be one of \('target', 'saved'\)"):
        checkpoints.restore_checkpoint(tmp_path, {"x": np.ones(1)}, config="file")  # pyright: ignore[reportCallIssue, reportArgumentType]  # a wrong value on purpose


def test_manager_save_with_filter_spec_saves_arrays_only(tmp_path):
    manager = checkpoints.CheckpointManager(tmp_path, handle_sigterm=False)
    manager.save(1, _state(p=0.1, seed=1), filter_spec=eqx.is_array)
    assert checkpoints.restore_checkpoint(tmp_path, None)["model"]["dropout"]["p"] is None
    assert manager.restore(_state(p=0.3)).model.dropout.p == 0.3


def test_manager_restore_passes_config_and_filter_spec(tmp_path):
    manager = checkpoints.CheckpointManager(tmp_path, handle_sigterm=False)
    manager.save(1, _state(p=0.1, seed=1))
    assert manager.restore(_state(p=0.3), config="saved").model.dropout.p == 0.1
    restored = manager.restore(_state(p=0.3), filter_spec=eqx.is_array)
    assert restored.model.dropout.p == 0.3
    for step in (1, None):  # a named step, and the latest with and without its fallback
        for fallback in (True, False):
            taken = manager.restore(_state(p=0.3), step, config="saved", fallback=fallback)
            assert taken.model.dropout.p == 0.1


def test_manager_restore_refuses_an_unknown_config_on_every_path(tmp_path, without_type_checks):
    manager = checkpoints.CheckpointManager(
        tmp_path, keep_best=1, best_metric="loss", handle_sigterm=False
    )
    manager.save(1, _state(p=0.1, seed=1), metrics={"loss": 1.0})
    for step, fallback in [(None, True), (None, False), (1, True), ("best", True)]:
        with pytest.raises(ValueError, match=r"config must be one of .*'taget'"):
            manager.restore(_state(p=0.3), step, config="taget", fallback=fallback)  # pyright: ignore[reportCallIssue, reportArgumentType]  # a wrong value on purpose


def test_manager_restore_of_the_best_passes_config(tmp_path):
    manager = checkpoints.CheckpointManager(
        tmp_path, keep_best=1, best_metric="loss", handle_sigterm=False
    )
    manager.save(1, _state(p=0.1, seed=1), metrics={"loss": 1.0})
    manager.save(2, _state(p=0.2, seed=2), metrics={"loss": 2.0})
    assert manager.restore(_state(p=0.3), "best", config="saved").model.dropout.p == 0.1
    with pytest.warns(checkpoints.ConfigMismatchWarning):
        assert manager.restore(_state(p=0.3), "best").model.dropout.p == 0.3


# ---------------------------------------------------------------- saved replicated


def test_restoring_a_replicated_save_unreplicated_says_to_unreplicate(tmp_path):
    state = _state(seed=1)
    checkpoints.save_checkpoint(tmp_path, eqx_train.replicate(state), 1)
    with pytest.raises(ValueError) as error:
        checkpoints.restore_checkpoint(tmp_path, _state(seed=2))
    message = str(error.value)
    assert "'model.linear.weight': file has (8, 3, 3) float32, target expects (3, 3)" in message
    assert (
        "saved replicated? Call eqx_train.unreplicate before saving, or restore into a "
        "replicated target" in message
    )
    replicated = checkpoints.restore_checkpoint(tmp_path, eqx_train.replicate(_state(seed=2)))
    assert_trees_equal(_arrays(eqx_train.unreplicate(replicated)), _arrays(state))


def test_a_plain_shape_mismatch_gets_no_replication_hint(tmp_path):
    checkpoints.save_checkpoint(tmp_path, {"a": np.ones((8, 3)), "b": np.ones(2)}, 1)
    with pytest.raises(ValueError) as error:
        checkpoints.restore_checkpoint(tmp_path, {"a": np.ones(3), "b": np.ones(3)})
    assert "replicated" not in str(error.value)
    checkpoints.save_checkpoint(tmp_path, {"a": np.ones((8, 3)), "b": np.ones((4, 2))}, 2)
    with pytest.raises(ValueError) as error:
        checkpoints.restore_checkpoint(tmp_path, {"a": np.ones(3), "b": np.ones(2)})
    assert "replicated" not in str(error.value)


def test_replication_hint_holds_for_typed_keys_and_numpy_scalars(tmp_path):
    tree = {"key": jax.random.key(0), "n": np.float32(1.5), "w": jnp.ones(2)}
    checkpoints.save_checkpoint(tmp_path, eqx_train.replicate(tree), 1)
    with pytest.raises(ValueError, match=r"saved replicated\?"):
        checkpoints.restore_checkpoint(tmp_path, tree)
