"""common_utils: flax's results, non-array leaves, host NumPy metrics, clear errors."""

from typing import cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.training import common_utils as flax_cu

from eqx_train import checkpoints, common_utils
from eqx_train.common_utils import numpy_rng_from_state, numpy_rng_state
from tests.support.helpers import assert_trees_equal


def test_shard_matches_flax():
    batch = {"x": np.arange(48.0).reshape(16, 3), "y": jnp.arange(16)}
    ours, theirs = common_utils.shard(batch), flax_cu.shard(batch)
    assert ours["x"].shape == (8, 2, 3)
    np.testing.assert_array_equal(ours["x"], theirs["x"])
    np.testing.assert_array_equal(ours["y"], theirs["y"])


def test_shard_keeps_numpy_as_numpy_and_non_array_leaves_unchanged():
    batch = {"x": np.zeros((8, 2)), "name": "digits", "fn": jax.nn.relu, "none": None}
    sharded = common_utils.shard(batch)
    assert isinstance(sharded["x"], np.ndarray)
    assert sharded["name"] == "digits" and sharded["fn"] is jax.nn.relu
    assert sharded["none"] is None


def test_shard_indivisible_batch_names_path_and_sizes():
    batch = {"inputs": {"image": np.zeros((10, 4))}}
    with pytest.raises(ValueError, match=r"'inputs\.image' has batch size 10.*device count 8"):
        common_utils.shard(batch)


def test_shard_scalar_leaf_names_path():
    with pytest.raises(ValueError, match=r"leaf 'lr' is a scalar"):
        common_utils.shard({"lr": np.float32(0.1)})


def test_shard_prng_key_matches_flax_for_raw_and_typed_keys():
    raw = jax.random.PRNGKey(3)
    np.testing.assert_array_equal(common_utils.shard_prng_key(raw), flax_cu.shard_prng_key(raw))
    typed = jax.random.key(3)
    ours = common_utils.shard_prng_key(typed)
    assert ours.shape == (8,)
    np.testing.assert_array_equal(
        jax.random.key_data(ours), jax.random.key_data(flax_cu.shard_prng_key(typed))
    )


def test_stack_forest_matches_flax_and_stacks_along_new_axis():
    forest = [{"a": jnp.full((2,), i), "b": (jnp.float32(i),)} for i in range(3)]
    ours, theirs = common_utils.stack_forest(forest), flax_cu.stack_forest(forest)
    assert ours["a"].shape == (3, 2)
    assert_trees_equal(ours, theirs)


def test_stack_forest_passes_equal_non_array_leaves_through():
    model = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))
    stacked = common_utils.stack_forest([model, model])
    assert stacked.activation is model.activation
    assert stacked.layers[0].weight.shape == (2, *model.layers[0].weight.shape)


def test_stack_forest_rejects_differing_non_array_leaves_with_path():
    with pytest.raises(ValueError, match=r"non-array leaf 'tag' differs"):
        common_utils.stack_forest([{"tag": "a", "x": np.ones(1)}, {"tag": "b", "x": np.ones(1)}])


def test_stack_forest_rejects_shape_mismatch_with_path():
    with pytest.raises(ValueError, match=r"leaf 'x' has different shapes"):
        common_utils.stack_forest([{"x": np.ones(2)}, {"x": np.ones(3)}])


def test_stack_forest_rejects_empty_forest():
    with pytest.raises(ValueError, match="empty"):
        common_utils.stack_forest([])


def test_get_metrics_returns_host_numpy_first_replica_stacked_over_time():
    step = jax.pmap(lambda x: {"loss": jnp.mean(x), "acc": x[0]}, axis_name="d")
    per_step = [step(jnp.arange(16.0).reshape(8, 2) + t) for t in range(3)]
    ours = common_utils.get_metrics(per_step)
    theirs = flax_cu.get_metrics(per_step)
    assert isinstance(ours["loss"], np.ndarray) and isinstance(ours["acc"], np.ndarray)
    np.testing.assert_array_equal(ours["loss"], [0.5, 1.5, 2.5])
    np.testing.assert_array_equal(ours["loss"], theirs["loss"])
    np.testing.assert_array_equal(ours["acc"], theirs["acc"])


def test_onehot_matches_flax_and_handles_out_of_range():
    labels = jnp.asarray([[0, 3], [2, 7]])
    ours = common_utils.onehot(labels, 4, on_value=2.0, off_value=-1.0)
    np.testing.assert_array_equal(ours, flax_cu.onehot(labels, 4, 2.0, -1.0))
    assert ours.dtype == jnp.float32 and ours.shape == (2, 2, 4)
    np.testing.assert_array_equal(ours[1, 1], [-1.0] * 4)
    np.testing.assert_array_equal(
        jax.jit(common_utils.onehot, static_argnums=1)(labels, 4), flax_cu.onehot(labels, 4)
    )


# ---------------------------------------------------------------- NumPy generators


BIT_GENERATORS = ["PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64"]


def _used_generator(name):
    rng = np.random.Generator(getattr(np.random, name)(12345))
    rng.random(7)
    rng.integers(0, 2**32, size=3, dtype=np.uint32)  # leaves half a 64-bit draw buffered
    return rng


@pytest.mark.parametrize("name", BIT_GENERATORS)
def test_numpy_rng_survives_a_checkpoint_and_continues_the_same_stream(tmp_path, name):
    rng = _used_generator(name)
    state = numpy_rng_state(rng)
    checkpoints.save_checkpoint(tmp_path, {"rng": state}, 1)
    expected = (rng.random(5), rng.integers(0, 2**32, size=5, dtype=np.uint32), rng.normal())
    template = {"rng": numpy_rng_state(np.random.Generator(getattr(np.random, name)(0)))}
    for target in (None, template):
        restored = cast(dict, checkpoints.restore_checkpoint(tmp_path, target))["rng"]
        again = numpy_rng_from_state(restored)
        got = (again.random(5), again.integers(0, 2**32, size=5, dtype=np.uint32), again.normal())
        assert_trees_equal(got, expected)


def test_numpy_rng_state_holds_pcg64s_128_bit_integers_as_two_words():
    rng = np.random.default_rng(3)
    raw = rng.bit_generator.state["state"]["state"]
    assert raw >= 2**64  # why the raw state cannot be a leaf
    words = numpy_rng_state(rng)["state"]["state"]
    assert words.dtype == np.uint64 and words.shape == (2,)
    assert int(words[0]) + (int(words[1]) << 64) == raw


def test_raw_generator_state_is_refused_by_checkpoints_naming_the_leaf(tmp_path):
    state = np.random.default_rng(3).bit_generator.state
    with pytest.raises(OverflowError, match=r"leaf 'state\.(inc|state)' is the int"):
        checkpoints.save_checkpoint(tmp_path, state, 1)


def test_numpy_rng_state_is_a_copy():
    rng = np.random.Generator(np.random.MT19937(1))
    state = numpy_rng_state(rng)
    before = state["state"]["key"].copy()
    rng.random(1000)
    np.testing.assert_array_equal(state["state"]["key"], before)


def test_numpy_rng_from_state_names_the_path_that_does_not_fit():
    state = numpy_rng_state(np.random.default_rng(0))
    state["state"]["inc"] = np.zeros(3, np.uint64)
    with pytest.raises(ValueError, match=r"'state\.inc' must be an array \(2,\) uint64, found"):
        numpy_rng_from_state(state)
    state = numpy_rng_state(np.random.default_rng(0))
    del state["has_uint32"]
    with pytest.raises(ValueError, match=r"'<root>' must have the keys"):
        numpy_rng_from_state(state)


@pytest.mark.parametrize("name", ["Generator", "os", 3, "NoSuchGenerator", "BitGenerator"])
def test_numpy_rng_from_state_refuses_anything_but_a_bit_generator_name(name):
    state = numpy_rng_state(np.random.default_rng(0))
    state["bit_generator"] = name
    with pytest.raises(ValueError, match="must name one of NumPy's bit generators"):
        numpy_rng_from_state(state)


def test_numpy_rng_state_refuses_a_non_generator(without_type_checks):
    with pytest.raises(TypeError, match="expected a numpy.random.Generator, got RandomState"):
        numpy_rng_state(np.random.RandomState(0))  # type: ignore[arg-type]
