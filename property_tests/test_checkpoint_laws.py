"""Checkpoint laws: restore(save(t)) == t bit for bit; retention == flax's for any history."""

import os
import tempfile

import equinox as eqx
import jax
import numpy as np
from flax.training import checkpoints as flax_checkpoints
from hypothesis import given, strategies as st

from eqx_train import checkpoints
from eqx_train.testing import assert_checkpoint_roundtrip, assert_trees_equal, strategies as ets
from property_tests.expected import as_saved


@given(tree=ets.pytrees(st.one_of(ets.arrays(), ets.keys())), as_jax=st.booleans())
def test_restore_save_is_identity_bit_for_bit(tree, as_jax):
    if as_jax:
        tree = jax.tree.map(lambda x: jax.numpy.asarray(x) if eqx.is_array(x) else x, tree)
    with tempfile.TemporaryDirectory() as ckpt_dir:
        # Into the tree: the tree itself (dtypes, shardings, configuration, bits); with
        # target=None: every saved leaf by name, dtype, shape and bits.
        assert_checkpoint_roundtrip(tree, ckpt_dir)
        # ...and target=None gives exactly the documented plain tree.
        assert_trees_equal(checkpoints.restore_checkpoint(ckpt_dir, None), as_saved(tree))


@given(pair=ets.modules())
def test_equinox_models_and_their_state_round_trip(pair):
    assert_checkpoint_roundtrip(pair)


@given(state=ets.train_states())
def test_train_states_round_trip(state):
    assert_checkpoint_roundtrip(state)


@given(tree=ets.pytrees())
def test_restore_into_fresh_target_gives_saved_arrays_and_target_functions(tree):
    blank = jax.tree.map(lambda x: np.zeros_like(x) if eqx.is_array(x) else x, tree)
    with tempfile.TemporaryDirectory() as ckpt_dir:
        checkpoints.save_checkpoint(ckpt_dir, tree, 1)
        restored = checkpoints.restore_checkpoint(ckpt_dir, blank)
    assert_trees_equal(eqx.filter(restored, eqx.is_array), eqx.filter(tree, eqx.is_array))
    # Leaf by leaf: arrays carry the file's values in the target's array type; every other
    # leaf (functions, static fields, configuration) is the target's own object.
    for got, target_leaf, saved in zip(
        jax.tree.leaves(restored), jax.tree.leaves(blank), jax.tree.leaves(tree), strict=True
    ):
        if eqx.is_array(saved):
            assert type(got) is type(target_leaf)
        else:
            assert got is target_leaf


history = st.lists(st.tuples(st.integers(0, 40), st.booleans()), min_size=1, max_size=20)


def _flax_apply(ckpt_dir, step, keep, keep_every_n_steps, overwrite):
    """flax's own retention code on empty files named as flax names them."""
    path = os.path.join(ckpt_dir, f"checkpoint_{step}")
    if not overwrite:
        try:
            flax_checkpoints._check_overwrite_error(
                path + "tmp", path, os.path.join(ckpt_dir, "checkpoint_"), step
            )
        except Exception:
            return False
    open(path, "w").close()
    flax_checkpoints._remove_invalid_ckpts(
        path, os.path.join(ckpt_dir, "checkpoint_"), keep, overwrite, keep_every_n_steps, False
    )
    return True


@given(
    saves=history,
    keep=st.integers(1, 4),
    keep_every_n_steps=st.one_of(st.none(), st.integers(1, 6)),
    float_steps=st.booleans(),
)
def test_retention_and_overwrite_match_flax(saves, keep, keep_every_n_steps, float_steps):
    with tempfile.TemporaryDirectory() as ours, tempfile.TemporaryDirectory() as theirs:
        for raw_step, overwrite in saves:
            step = raw_step / 2 if float_steps else raw_step
            accepted = _flax_apply(theirs, step, keep, keep_every_n_steps, overwrite)
            try:
                checkpoints.save_checkpoint(
                    ours,
                    {"s": np.asarray(step)},
                    step,
                    keep=keep,
                    keep_every_n_steps=keep_every_n_steps,
                    overwrite=overwrite,
                )
                we_accepted = True
            except ValueError:
                we_accepted = False
            assert we_accepted == accepted
            flax_steps = sorted(float(n[len("checkpoint_") :]) for n in os.listdir(theirs))
            assert [float(s) for s in checkpoints.available_steps(ours, step_type=float)] == (
                flax_steps
            )
