"""A restored leaf is placed exactly as the target's: jitted code cannot tell them apart.

Sharding, committedness (an uncommitted target leaf, `jnp.zeros(())` or `EarlyStopping`'s
fields, comes back uncommitted), weak type, dtype and shape, on every restore path; with
`target=None`, JAX leaves are placed as `jnp.asarray` places them (uncommitted, default
device)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_train import EarlyStopping
from eqx_train.checkpoints import (
    CheckpointManager,
    restore_checkpoint,
    save_checkpoint,
    save_checkpoint_multiprocess,
)
from eqx_train.interop import from_state_dict, load_sharded, save_sharded, to_state_dict

MESH = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
SHARDED = jax.sharding.NamedSharding(MESH, jax.sharding.PartitionSpec("d"))
DEVICE_3 = jax.devices()[3]


def _placement(x):
    """What jitted code sees of a leaf besides its values, computed from JAX's own fields."""
    ids = sorted(d.id for d in x.sharding.device_set)
    weak = None if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x.weak_type
    return (str(x.dtype), x.shape, weak, x.committed, ids, type(x.sharding).__name__)


def _tree():
    """Every placement a training state holds: uncommitted (strong, weak, a key), committed
    to one device, sharded over the mesh, and EarlyStopping's uncommitted fields."""
    return {
        "zeros": jnp.zeros(()),
        "weak": jnp.asarray(0.5),
        "counter": jnp.asarray(3),
        "key": jax.random.key(1),
        "on_3": jax.device_put(jnp.arange(4.0), DEVICE_3),
        "sharded": jax.device_put(jnp.arange(16.0), SHARDED),
        "sharded_key": jax.device_put(jax.random.split(jax.random.key(2), 8), SHARDED),
        "early_stopping": EarlyStopping(patience=2).update(1.0),
    }


def _values_differ(tree):
    """The same placements as `tree`, other values: a restore must bring the saved ones."""

    def other(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(~jax.random.key_data(x), impl=jax.random.key_impl(x))
        return ~x if x.dtype == jnp.bool_ else x + 1

    return jax.tree.map(other, tree)


def _assert_placed_as(restored, expected):
    got, want = jax.tree.leaves(restored), jax.tree.leaves(expected)
    assert [_placement(x) for x in got] == [_placement(x) for x in want]


def test_uncommitted_target_leaves_stay_uncommitted(tmp_path):
    tree = _tree()
    assert not tree["zeros"].committed and not tree["early_stopping"].best_metric.committed
    save_checkpoint(tmp_path, tree, 1)
    restored = restore_checkpoint(tmp_path, _values_differ(tree))
    _assert_placed_as(restored, tree)
    assert float(restored["early_stopping"].best_metric) == 1.0  # the saved value


def test_an_uncommitted_leaf_off_the_default_device_stays_on_its_device(tmp_path):
    with jax.default_device(DEVICE_3):
        tree = {"w": jnp.arange(3.0), "weak": jnp.asarray(1.0), "key": jax.random.key(0)}
    assert {x.committed for x in jax.tree.leaves(tree)} == {False}
    save_checkpoint(tmp_path, tree, 1)
    _assert_placed_as(restore_checkpoint(tmp_path, tree), tree)


def test_sharded_layout_places_like_the_target(tmp_path):
    tree = _tree()
    save_checkpoint_multiprocess(tmp_path, tree, 1)
    assert any(p.name.endswith(".shards") for p in tmp_path.iterdir())
    _assert_placed_as(restore_checkpoint(tmp_path, _values_differ(tree)), tree)


def test_checkpoint_manager_restore_places_like_the_target(tmp_path):
    tree = _tree()
    manager = CheckpointManager(tmp_path)
    manager.save(1, tree)
    manager.wait()
    _assert_placed_as(manager.restore(_values_differ(tree)), tree)


def _abstract(x):
    """A `ShapeDtypeStruct` as a user writes one: with the sharding of a committed leaf,
    without one for an uncommitted leaf."""
    sharding = x.sharding if x.committed else None
    weak = False if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x.weak_type
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=weak)


def test_abstract_targets_place_with_their_sharding_or_as_jnp_asarray(tmp_path):
    tree = _tree()
    save_checkpoint(tmp_path, tree, 1)
    restored = restore_checkpoint(tmp_path, jax.tree.map(_abstract, tree))
    # The leaf on device 3 was committed: its ShapeDtypeStruct carries that sharding.
    _assert_placed_as(restored, tree)


def test_target_none_places_jax_leaves_as_jnp_asarray_does(tmp_path):
    tree = {"weak": jnp.asarray(0.5), "key": jax.device_put(jax.random.key(1), DEVICE_3)}
    save_checkpoint(tmp_path, tree, 1)
    restored = restore_checkpoint(tmp_path, None)
    like_asarray = {"weak": jnp.asarray(0.5), "key": jax.random.key(1)}
    _assert_placed_as(restored, like_asarray)
    with jax.default_device(DEVICE_3):
        restored = restore_checkpoint(tmp_path, None)
        like_asarray = {"weak": jnp.asarray(0.5), "key": jax.random.key(1)}
    _assert_placed_as(restored, like_asarray)


def test_hugging_face_and_state_dict_loads_place_like_the_target(tmp_path):
    tree = {"zeros": jnp.zeros(3), "weak": jnp.asarray(0.5), "on_3": _tree()["on_3"]}
    save_sharded(tmp_path, tree)
    _assert_placed_as(load_sharded(tmp_path, _values_differ(tree)), tree)
    _assert_placed_as(from_state_dict(_values_differ(tree), to_state_dict(tree)), tree)


def test_resumed_early_stopping_meets_a_mesh_sharded_metric_as_the_fresh_one_does(tmp_path):
    # The crash: restored fields committed to device 0 met a metric on all 8 devices.
    fresh = {"step": jnp.asarray(0), "early_stopping": EarlyStopping(patience=2)}
    save_checkpoint(tmp_path, fresh, 1)
    resumed = restore_checkpoint(tmp_path, fresh)
    val_loss = jax.device_put(jnp.full(8, 0.25), SHARDED).mean()
    update = eqx.filter_jit(lambda state, metric: state["early_stopping"].update(metric))
    expected = update(fresh, val_loss)
    got = update(resumed, val_loss)
    assert jax.tree.map(np.asarray, got) == jax.tree.map(np.asarray, expected)
    _assert_placed_as(got, expected)


@pytest.mark.parametrize("jit", [jax.jit, eqx.filter_jit], ids=["jax.jit", "eqx.filter_jit"])
def test_a_jitted_step_does_not_compile_again_after_a_restore(tmp_path, jit):
    tree = _tree()
    del tree["on_3"]  # one jitted computation: every committed leaf on the same devices
    step = jit(lambda t: jax.tree.map(lambda x: x[..., None], t))  # keys too
    step(tree)
    save_checkpoint(tmp_path, tree, 1)
    step(restore_checkpoint(tmp_path, _values_differ(tree)))
    cache_size = step._cache_size if jit is jax.jit else step._cached._cache_size
    assert cache_size() == 1
