"""Review of `rename=`: what its refusals say, for prefixes that overlap."""

import numpy as np
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints import plan_restore, restore_checkpoint


@pytest.fixture
def directory(tmp_path):
    checkpoints.save_checkpoint(tmp_path, {"enc": {"w": np.ones(3, np.float32)}}, 1)
    return tmp_path


def test_an_entry_shadowed_by_a_longer_prefix_is_not_said_to_match_no_leaf(directory):
    # 'x.w' is under 'x', but the longer 'x.w' takes it: the entry 'x' is dead, and the
    # refusal says why, not that no target leaf is under 'x'.
    target = {"x": {"w": np.zeros(3, np.float32)}}
    rename = {"x": "encoder", "x.w": "enc.w"}
    [problem] = plan_restore(directory, target, rename=rename).problems
    assert "no target leaf" not in problem
    assert "'x.w'" in problem and "longer" in problem
    with pytest.raises(ValueError, match="longer"):
        restore_checkpoint(directory, target, rename=rename)


def test_an_entry_that_matches_no_leaf_still_says_so(directory):
    target = {"enc": {"w": np.zeros(3, np.float32)}}
    [problem] = plan_restore(directory, target, rename={"dec": "enc"}).problems
    assert "no target leaf is named 'dec' or under it" in problem


def test_an_error_raised_by_a_rename_function_names_the_leaf_it_was_given(directory):
    target = {"enc": {"w": np.zeros(3, np.float32)}}
    with pytest.raises(KeyError) as raised:
        restore_checkpoint(directory, target, rename=lambda name: {}[name])
    assert "rename('enc.w')" in "\n".join(getattr(raised.value, "__notes__", []))


def test_the_root_prefix_maps_a_bare_array_target(directory):
    # `""` is the root: a target that is one array (named '<root>' in errors) takes the
    # saved tensor the root is mapped to.
    restored = restore_checkpoint(directory, np.zeros(3, np.float32), rename={"": "enc.w"})
    np.testing.assert_array_equal(restored, np.ones(3, np.float32))


def test_a_prefix_mapped_to_the_root_takes_a_checkpoint_of_one_array(tmp_path):
    checkpoints.save_checkpoint(tmp_path, np.arange(3, dtype=np.float32), 1)
    restored = restore_checkpoint(tmp_path, {"w": np.zeros(3, np.float32)}, rename={"w": ""})
    np.testing.assert_array_equal(restored["w"], np.arange(3, dtype=np.float32))
