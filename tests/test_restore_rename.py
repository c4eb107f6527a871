"""`rename=`: what its refusals say, for prefixes that overlap, and what a renamed leaf holds."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

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


# -------------------------------------------------- the prefix rule against a reference

SEGMENTS = ["a", "ab", "b"]  # "a" is a string prefix of "ab" but not a segment prefix
SAVED_NAMES = [f"{x}.{y}.{z}" for x in SEGMENTS for y in SEGMENTS for z in SEGMENTS]


def _nested(names, value):
    tree = {}
    for name in names:
        node = tree
        *parents, last = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return tree


def _reference_source(name, rename):
    """The rule as the docs state it, written out independently of the matcher."""
    best = None
    for prefix in rename:
        segments = prefix.split(".") if prefix else []
        if name.split(".")[: len(segments)] == segments:
            if best is None or len(segments) > len(best.split(".") if best else []):
                best = prefix
    if best is None:
        return name
    rest = name.split(".")[len(best.split(".")) if best else 0 :]
    return ".".join([rename[best]] * bool(rename[best]) + rest)


@pytest.fixture(scope="module")
def universe(tmp_path_factory):
    directory = tmp_path_factory.mktemp("universe")
    checkpoints.save_checkpoint(directory, _nested(SAVED_NAMES, np.ones(1, np.float32)), 1)
    return directory


def _prefix_of(depth):
    return st.lists(st.sampled_from(SEGMENTS), min_size=depth, max_size=depth).map(".".join)


@st.composite
def _renames(draw):
    rename = {}
    for _ in range(draw(st.integers(1, 4))):
        depth = draw(st.integers(0, 3))  # a saved prefix as deep: the source stays a leaf
        rename[draw(_prefix_of(depth))] = draw(_prefix_of(depth))
    return rename


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    targets=st.lists(st.sampled_from(SAVED_NAMES), min_size=1, max_size=8, unique=True),
    rename=_renames(),
)
def test_each_target_leaf_takes_the_saved_name_the_longest_whole_segment_prefix_gives(
    universe, targets, rename
):
    target = _nested(targets, np.zeros(1, np.float32))
    plan = plan_restore(universe, target, rename=rename, strict=False)
    assert plan.taken == {name: _reference_source(name, rename) for name in targets}


def test_a_saved_tensor_no_leaf_takes_is_unused_even_under_a_leaf_renamed_to_none(tmp_path):
    # rename -> None: the leaf 'b' has no source, so the saved 'b' is taken by no leaf:
    # `unused` is "saved names no leaf takes", and a strict restore refuses it.
    checkpoints.save_checkpoint(tmp_path, {"w": np.ones(2), "b": np.ones(2)}, 1)
    target = {"w": np.zeros(2), "b": np.zeros(2)}

    def rename(name):
        return None if name == "b" else name

    plan = plan_restore(tmp_path, target, rename=rename, strict=False)
    assert plan.unused == ["b"] and plan.kept == ["b"]
    with pytest.raises(ValueError, match="'b': in the file as"):
        restore_checkpoint(tmp_path, target, rename=rename)


def test_tied_numpy_leaves_restored_from_one_tensor_do_not_alias(tmp_path):
    checkpoints.save_checkpoint(tmp_path, {"emb": np.arange(3.0)}, 1)
    target = {"emb": np.zeros(3), "out": np.zeros(3)}
    restored = restore_checkpoint(tmp_path, target, rename={"out": "emb"})
    np.testing.assert_array_equal(restored["out"], np.arange(3.0))
    restored["out"] += 1
    np.testing.assert_array_equal(restored["emb"], np.arange(3.0))
