"""to_state_dict / from_state_dict with what Equinox users hold beside weights: an
`eqx.nn.State` (named by its `StateIndex` markers, as checkpoint files name it; the old
positional names still load), BatchNorm's weakly typed counter, and typed PRNG keys."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_train.checkpoints import plan_restore, save_checkpoint
from eqx_train.checkpoints.engine import FileReader
from eqx_train.interop import from_state_dict, to_state_dict
from tests.support.helpers import assert_trees_equal


class CNN(eqx.Module):
    lin: eqx.nn.Linear
    bn: eqx.nn.BatchNorm

    def __init__(self, key):
        self.lin = eqx.nn.Linear(3, 4, key=key)
        self.bn = eqx.nn.BatchNorm(4, "batch", mode="batch")

    def __call__(self, x, state):
        return self.bn(self.lin(x), state)


class TwoNorms(eqx.Module):
    """`CNN` with a second BatchNorm in front: JAX's positions of `bn`'s entries move."""

    lin: eqx.nn.Linear
    first: eqx.nn.BatchNorm
    bn: eqx.nn.BatchNorm

    def __init__(self, key):
        self.lin = eqx.nn.Linear(3, 4, key=key)
        self.first = eqx.nn.BatchNorm(4, "batch", mode="batch")
        self.bn = eqx.nn.BatchNorm(4, "batch", mode="batch")


STATE_NAMES = {  # what checkpoint files, plan_restore and `inspect --tree` say
    "bn_state.CNN.bn.batch_counter": ((), np.int32),
    "bn_state.CNN.bn.batch_state_index.0": ((4,), np.float32),
    "bn_state.CNN.bn.batch_state_index.1": ((4,), np.float32),
}
OLD_NAMES = {  # what to_state_dict said before: JAX's positions in the State
    "bn_state.CNN.bn.batch_counter": "bn_state.0",
    "bn_state.CNN.bn.batch_state_index.0": "bn_state.1.0",
    "bn_state.CNN.bn.batch_state_index.1": "bn_state.1.1",
}


def _trained(seed: int = 0) -> dict:
    """A CNN and its State after one training step (counter 1, statistics not the init's)."""
    model, state = eqx.nn.make_with_state(CNN)(jax.random.key(seed))
    x = jax.random.normal(jax.random.key(seed + 10), (5, 3))
    batched = jax.vmap(model, in_axes=(0, None), out_axes=(0, None), axis_name="batch")
    _, state = batched(x, state)
    return {"model": model, "bn_state": state}


def _fresh() -> dict:
    model, state = eqx.nn.make_with_state(CNN)(jax.random.key(7))
    return {"model": model, "bn_state": state}


# ------------------------------------------------------------------------ one name per entry


def test_state_entries_are_named_by_their_markers():
    state_dict = to_state_dict(_trained())
    found = {n: (v.shape, v.dtype.type) for n, v in state_dict.items() if n.startswith("bn_")}
    assert found == STATE_NAMES


def test_state_entries_have_the_names_of_checkpoint_files_and_plan_restore(tmp_path):
    tree = _trained()
    path = save_checkpoint(tmp_path, tree, step=0)
    with FileReader(str(path)) as reader:
        in_file = set(reader.tensors)
    plan = plan_restore(tmp_path, _fresh())
    names = set(to_state_dict(tree))
    assert names <= in_file and set(STATE_NAMES) <= set(plan.taken)


def test_state_round_trips_bit_for_bit():
    saved = _trained()
    assert_trees_equal(from_state_dict(_fresh(), to_state_dict(saved)), saved)


def test_state_entries_load_into_their_layer_when_a_stateful_layer_is_added():
    saved = to_state_dict(_trained())
    model, state = eqx.nn.make_with_state(TwoNorms)(jax.random.key(1))
    target = {"model": model, "bn_state": state}
    key_map = {n: n.replace("CNN", "TwoNorms") for n in saved}
    loaded, report = from_state_dict(target, saved, key_map=key_map, strict=False)
    assert report.missing == (
        "bn_state.TwoNorms.first.batch_counter",
        "bn_state.TwoNorms.first.batch_state_index.0",
        "bn_state.TwoNorms.first.batch_state_index.1",
        "model.first.bias",
        "model.first.weight",
    )
    assert not report.unexpected and not report.mismatched
    mean = loaded["bn_state"].get(loaded["model"].bn.batch_state_index)[0]
    np.testing.assert_array_equal(mean, saved["bn_state.CNN.bn.batch_state_index.0"])


def test_old_positional_state_names_still_load():
    saved = _trained()
    old = {OLD_NAMES.get(n, n): v for n, v in to_state_dict(saved).items()}
    assert "bn_state.1.0" in old
    assert_trees_equal(from_state_dict(_fresh(), old), saved)


def test_old_positional_names_of_a_state_of_another_size_are_refused_naming_the_new_names():
    old = {OLD_NAMES.get(n, n): v for n, v in to_state_dict(_trained()).items()}
    model, state = eqx.nn.make_with_state(TwoNorms)(jax.random.key(1))
    target = {"model": model, "bn_state": state}
    with pytest.raises(ValueError, match="by position") as error:
        from_state_dict(target, old, strict=False)
    message = str(error.value)
    assert "bn_state.TwoNorms.first.batch_counter" in message and "6 entries" in message
    assert "key_map=" in message


# ------------------------------------------------------------------------ weak types


def test_loaded_batchnorm_counter_stays_weak_so_a_jitted_step_compiles_once():
    compiles = []

    @eqx.filter_jit
    def step(tree, x):
        compiles.append(None)
        batched = jax.vmap(tree["model"], in_axes=(0, None), out_axes=(0, None), axis_name="batch")
        y, state = batched(x, tree["bn_state"])
        return y.sum(), state

    fresh = _fresh()
    x = jnp.ones((5, 3))
    step(fresh, x)
    loaded = from_state_dict(fresh, to_state_dict(_trained()))
    step(loaded, x)
    assert len(compiles) == 1
    counter = loaded["bn_state"].get(loaded["model"].bn.batch_counter)
    assert counter.weak_type and int(counter) == 1


# ------------------------------------------------------------------------ typed PRNG keys


@pytest.mark.parametrize(("impl", "data_shape"), [("threefry2x32", (2,)), ("rbg", (4,))])
def test_a_typed_key_loads_from_its_key_data_with_the_targets_implementation(impl, data_shape):
    saved = jax.random.key(5, impl=impl)
    data = np.asarray(jax.random.key_data(saved))
    assert data.shape == data_shape and data.dtype == np.uint32
    target = {"key": jax.random.key(0, impl=impl), "w": jnp.zeros(1)}
    loaded = from_state_dict(target, {"key": data, "w": np.ones(1, np.float32)})
    assert jax.random.key_impl(loaded["key"]) == jax.random.key_impl(saved)
    np.testing.assert_array_equal(jax.random.key_data(loaded["key"]), data)


def test_a_typed_key_loads_from_a_key_array_and_into_an_abstract_target():
    saved = jax.random.split(jax.random.key(5), 3)
    target = eqx.filter_eval_shape(lambda: {"keys": jax.random.split(jax.random.key(0), 3)})
    loaded = from_state_dict(target, {"keys": saved})
    assert jnp.issubdtype(loaded["keys"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(loaded["keys"]), jax.random.key_data(saved))


def test_key_data_of_another_shape_is_a_mismatch_not_a_naming_problem():
    target = {"key": jax.random.key(0)}
    with pytest.raises(ValueError, match="Mismatched") as error:
        from_state_dict(target, {"key": np.zeros(4, np.uint32)})
    message = str(error.value)
    assert "'key': the state dict has uint32[4], the target uint32[2]" in message
    assert "Unexpected" not in message


def test_non_strict_reports_every_key_it_kept_from_the_target():
    target = {"key": jax.random.key(3), "w": jnp.zeros(1)}
    loaded, report = from_state_dict(target, {"w": np.ones(1, np.float32)}, strict=False)
    assert report.kept_keys == ("key",) and not report.missing and not report.unexpected
    np.testing.assert_array_equal(
        jax.random.key_data(loaded["key"]), jax.random.key_data(target["key"])
    )
    _, report = from_state_dict(
        target, {"w": np.ones(1, np.float32), "key": np.zeros(2, np.uint32)}, strict=False
    )
    assert report.kept_keys == ()


def test_a_loaded_key_is_placed_as_the_target_key():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    target = {"keys": jax.device_put(jax.random.split(jax.random.key(0), 8), sharding)}
    data = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(3), 8)))
    loaded = from_state_dict(target, {"keys": data})
    assert loaded["keys"].sharding == sharding
    uncommitted = from_state_dict({"key": jax.random.key(0)}, {"key": data[0]})["key"]
    assert not uncommitted.committed
