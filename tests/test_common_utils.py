"""common_utils: flax's results, non-array leaves, host NumPy metrics, clear errors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.training import common_utils as flax_cu

from eqx_train import common_utils
from tests.helpers import assert_trees_equal


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
