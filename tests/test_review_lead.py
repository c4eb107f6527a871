"""Defects found in review of the model-changes work (issue 27), fixed outside the matcher."""

import numpy as np
import pytest

from eqx_train.checkpoints import restore_checkpoint, save_checkpoint


def test_tied_numpy_leaves_restored_from_one_tensor_do_not_alias(tmp_path):
    save_checkpoint(tmp_path, {"emb": np.arange(3.0)}, 1)
    target = {"emb": np.zeros(3), "out": np.zeros(3)}
    restored = restore_checkpoint(tmp_path, target, rename={"out": "emb"})
    np.testing.assert_array_equal(restored["out"], np.arange(3.0))
    restored["out"] += 1
    np.testing.assert_array_equal(restored["emb"], np.arange(3.0))


@pytest.mark.parametrize(
    "option",
    [{"rename": {"b": "a"}}, {"casting": "unsafe"}, {"filter_spec": lambda x: False}],
    ids=["rename", "casting", "filter_spec"],
)
def test_target_options_with_target_none_are_refused_not_ignored(tmp_path, option):
    save_checkpoint(tmp_path, {"a": np.arange(3.0)}, 1)
    (name,) = option
    with pytest.raises(ValueError, match=rf"restore_checkpoint: {name} applies to a target"):
        restore_checkpoint(tmp_path, None, **option)
