"""`transform=`: saved tensors stored in another layout than the target's (a transposed
kernel, a fused QKV projection) reshaped on the host after reading, before the cast and the
shape check; the plan's view of it (shapes before and after, no data read); the refusals
of bad transforms; and the hint when a saved shape is a permutation of the target's."""

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eqx_train import checkpoints
from eqx_train.checkpoints import CheckpointManager, plan_restore, restore_checkpoint
from tests.support.helpers import assert_trees_equal, flip_last_byte

KERNEL = np.arange(128, dtype=np.float32).reshape(8, 16)  # saved (in, out), as flax does
QKV = np.arange(4 * 9, dtype=np.float32).reshape(4, 9)  # q, k, v side by side on axis 1
SPLIT = {"q": "qkv", "k": "qkv", "v": "qkv"}


@pytest.fixture(params=["file", "shards"])
def directory(request, tmp_path):
    """A checkpoint of `{"w": KERNEL, "qkv": QKV}`, as one file or a `.shards` directory."""
    tree = {"w": KERNEL, "qkv": QKV}
    if request.param == "file":
        checkpoints.save_checkpoint(tmp_path, tree, 1)
    else:
        checkpoints.save_checkpoint_multiprocess(tmp_path, tree, 1)
    return tmp_path


def _qkv_target():
    return {"q": jnp.zeros((4, 3)), "k": jnp.zeros((4, 3)), "v": jnp.zeros((4, 3))}


def test_a_mapping_transform_restores_a_transposed_kernel(directory):
    restored = restore_checkpoint(
        directory,
        {"w": jnp.zeros((16, 8)), **_qkv_target()},
        rename=SPLIT,
        transform={"w": lambda a: a.T, "q": lambda a: a[:, :3], "k": lambda a: a[:, 3:6],
                   "v": lambda a: a[:, 6:]},
    )  # fmt: skip
    assert_trees_equal(restored["w"], np.ascontiguousarray(KERNEL.T))


def test_a_fused_qkv_splits_into_three_leaves_of_one_saved_tensor(directory):
    thirds = {"q": lambda a: a[:, :3], "k": lambda a: a[:, 3:6], "v": lambda a: a[:, 6:]}
    restored = restore_checkpoint(
        directory,
        {"w": jnp.zeros((8, 16)), **_qkv_target()},
        rename=SPLIT,
        transform=thirds,
        host_window_bytes=64,  # one tensor per group: the tied leaves still share one read
    )
    for i, name in enumerate("qkv"):
        expected = np.array([[row[3 * i + j] for j in range(3)] for row in QKV.tolist()])
        assert_trees_equal(restored[name], expected.astype(np.float32))


def test_a_function_transform_applies_where_it_returns_an_array(directory):
    seen = []

    def transform(name, array):
        seen.append(name)
        return array.T if name == "w" else None

    restored = restore_checkpoint(
        directory, {"w": jnp.zeros((16, 8)), "qkv": jnp.zeros((4, 9))}, transform=transform
    )
    assert_trees_equal(restored["w"], KERNEL.T.copy())
    assert_trees_equal(restored["qkv"], QKV)
    assert set(seen) == {"w", "qkv"}


def test_a_reshape_transform_restores_a_flattened_tensor(directory):
    restored = restore_checkpoint(
        directory,
        {"w": jnp.zeros((8, 4, 4)), "qkv": jnp.zeros((36,))},
        transform={"w": lambda a: a.reshape(8, 4, 4), "qkv": lambda a: a.reshape(-1)},
    )
    assert_trees_equal(restored["w"], KERNEL.reshape(8, 4, 4))
    assert_trees_equal(restored["qkv"], np.arange(36, dtype=np.float32))


def test_jnp_functions_work_as_transforms(directory):
    restored = restore_checkpoint(
        directory,
        {"w": jnp.zeros((16, 8)), "qkv": jnp.zeros((4, 3))},
        transform={"w": jnp.transpose, "qkv": lambda a: jnp.split(a, 3, axis=1)[1]},
    )
    assert_trees_equal(restored["w"], KERNEL.T.copy())
    assert_trees_equal(restored["qkv"], QKV[:, 3:6].copy())


def test_a_transform_output_larger_than_the_saved_tensor_is_restored(directory):
    restored = restore_checkpoint(
        directory,
        {"w": jnp.zeros((16, 16)), "qkv": jnp.zeros((4, 9))},
        transform={"w": lambda a: jnp.concatenate([a, a])},
        host_window_bytes=64,
    )
    assert_trees_equal(restored["w"], np.vstack([KERNEL, KERNEL]))


def test_the_transform_receives_the_saved_tensor_as_read_only_numpy(directory):
    received = []

    def transform(name, array):
        if isinstance(array, np.ndarray):
            received.append((array.dtype, array.shape, array.flags.writeable))
        return array

    restore_checkpoint(
        directory, {"w": np.zeros((8, 16), np.float32), "qkv": QKV * 0}, transform=transform
    )
    assert sorted(received) == [(np.float32, (4, 9), False), (np.float32, (8, 16), False)]


def test_a_transform_cannot_make_its_input_writable_and_change_a_tied_leaf(directory):
    # Two targets take the saved QKV: one through a transform that tries to write into its
    # input, one as saved. The saved bytes are the other leaf's too: they must not change.
    refusals = []

    def scribble(array):
        if isinstance(array, np.ndarray):
            try:
                array.flags.writeable = True
                array[...] = -1
            except ValueError as error:
                refusals.append(str(error))
        return array

    restored = restore_checkpoint(
        directory,
        {"scribbled": jnp.zeros((4, 9)), "qkv": jnp.zeros((4, 9)), "w": jnp.zeros((8, 16))},
        rename={"scribbled": "qkv"},
        transform={"scribbled": scribble},
    )
    assert len(refusals) == 1
    assert_trees_equal(restored["qkv"], jnp.asarray(QKV))
    assert_trees_equal(restored["scribbled"], jnp.asarray(QKV))


def test_a_transform_of_a_scalar_and_a_zero_size_tensor_keeps_their_shapes(tmp_path):
    checkpoints.save_checkpoint(tmp_path, {"s": np.float32(3), "z": np.zeros((0, 2))}, 1)
    restored = restore_checkpoint(
        tmp_path, {"s": jnp.zeros(()), "z": np.ones((0, 2))}, transform=lambda _, a: a * 2
    )
    assert_trees_equal(restored, {"s": jnp.asarray(6, jnp.float32), "z": np.zeros((0, 2))})


def test_the_transform_runs_before_the_cast_into_bfloat16(directory):
    dtypes = []

    def transpose(array):
        dtypes.append(array.dtype)
        return array.T

    restored = restore_checkpoint(
        directory,
        {"w": jnp.zeros((16, 8), jnp.bfloat16), "qkv": jnp.zeros((4, 9), jnp.bfloat16)},
        transform={"w": transpose},
        casting="same_kind",
    )
    assert set(dtypes) == {np.dtype(np.float32)}  # evaluated and run on the saved dtype
    assert_trees_equal(restored["w"], KERNEL.T.astype(ml_dtypes.bfloat16))


def test_a_transformed_leaf_keeps_the_target_sharding(directory):
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    sharding = NamedSharding(mesh, PartitionSpec("x"))
    target = {
        "w": jax.device_put(jnp.zeros((16, 8)), sharding),
        "qkv": jax.device_put(jnp.zeros((4, 9)), sharding),
    }
    restored = restore_checkpoint(directory, target, transform={"w": lambda a: a.T})
    assert restored["w"].sharding == sharding
    assert_trees_equal(restored["w"], KERNEL.T.copy())
    assert_trees_equal(restored["qkv"], QKV)


def test_the_manager_restores_through_a_transform(tmp_path):
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, {"w": KERNEL})
        restored = manager.restore({"w": jnp.zeros((16, 8))}, transform={"w": lambda a: a.T})
    assert_trees_equal(restored["w"], KERNEL.T.copy())


# ------------------------------------------------------------------------ Equinox models


def test_a_linear_layer_takes_a_kernel_saved_in_input_output_order(tmp_path):
    saved = eqx.nn.Linear(8, 16, key=jax.random.key(0))
    kernel = np.asarray(saved.weight).T.copy()  # (in, out), as flax and Keras store it
    checkpoints.save_checkpoint(tmp_path, {"weight": kernel, "bias": saved.bias}, 1)
    target = eqx.nn.Linear(8, 16, key=jax.random.key(1))
    restored = restore_checkpoint(tmp_path, target, transform={"weight": lambda a: a.T})
    assert_trees_equal(restored, saved)


def test_a_conv_takes_a_kernel_saved_as_height_width_in_out(tmp_path):
    saved = eqx.nn.Conv2d(3, 5, kernel_size=(2, 4), key=jax.random.key(0))
    hwio = np.transpose(np.asarray(saved.weight), (2, 3, 1, 0)).copy()  # flax's layout
    checkpoints.save_checkpoint(tmp_path, {"weight": hwio, "bias": saved.bias}, 1)
    target = eqx.nn.Conv2d(3, 5, kernel_size=(2, 4), key=jax.random.key(1))
    with pytest.raises(ValueError, match=r"lambda a: a.transpose\(3, 2, 0, 1\)"):
        restore_checkpoint(tmp_path, target)
    restored = restore_checkpoint(
        tmp_path, target, transform={"weight": lambda a: a.transpose(3, 2, 0, 1)}
    )
    assert_trees_equal(restored, saved)


def test_the_entries_of_an_eqx_state_are_transformed_by_their_names(tmp_path):
    model, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", mode="ema")
    running = (np.array([1.0, 2.0, 3.0], np.float32), np.array([4.0, 5.0, 6.0], np.float32))
    assert model.ema_state_index is not None  # mode='ema'
    state = state.set(model.ema_state_index, (jnp.asarray(running[0]), jnp.asarray(running[1])))
    checkpoints.save_checkpoint(tmp_path, {"model": model, "state": state}, 1)
    names = []

    def reverse_statistics(name, array):
        if name.startswith("state.") and "ema_state_index" in name:
            names.append(name)
            return array[::-1]
        return None

    restored = restore_checkpoint(
        tmp_path, {"model": model, "state": state}, transform=reverse_statistics
    )
    mean, var = restored["state"].get(model.ema_state_index)
    assert_trees_equal((mean, var), (running[0][::-1].copy(), running[1][::-1].copy()))
    # Named by the State's marker (evaluated, then run), not by position.
    assert set(names) == {"state.BatchNorm.ema_state_index.0", "state.BatchNorm.ema_state_index.1"}


# ------------------------------------------------------------------------------- plans


def test_the_plan_lists_each_transformed_leaf_with_its_shapes_before_and_after(directory):
    target = {"w": jnp.zeros((16, 8), jnp.bfloat16), **_qkv_target()}
    thirds = {"q": lambda a: a[:, :3], "k": lambda a: a[:, 3:6], "v": lambda a: a[:, 6:]}
    plan = plan_restore(
        directory, target, rename=SPLIT, transform={"w": lambda a: a.T, **thirds},
        casting="same_kind",
    )  # fmt: skip
    assert plan.ok
    assert plan.transformed == {
        "w": ((8, 16), (16, 8)),
        "q": ((4, 9), (4, 3)),
        "k": ((4, 9), (4, 3)),
        "v": ((4, 9), (4, 3)),
    }
    assert plan.cast == {"w": (np.dtype(np.float32), np.dtype(jnp.bfloat16))}
    text = str(plan)
    assert "transformed (8, 16) -> (16, 8), cast float32 -> bfloat16" in text
    assert "transformed (4, 9) -> (4, 3)" in text


def test_the_plan_evaluates_transforms_without_reading_tensor_data(tmp_path):
    path = checkpoints.save_checkpoint(tmp_path, {"w": KERNEL}, 1)
    flip_last_byte(path)  # the data no longer verifies; a plan never reads it
    plan = plan_restore(path, {"w": jnp.zeros((16, 8))}, transform={"w": lambda a: a.T})
    assert plan.ok and plan.transformed == {"w": ((8, 16), (16, 8))}


# ------------------------------------------------------------------------------ refusals


def _refusal(directory, transform, target=None):
    target = target or {"w": jnp.zeros((16, 8)), "qkv": jnp.zeros((4, 9))}
    with pytest.raises(ValueError) as caught:
        restore_checkpoint(directory, target, transform=transform)
    plan = plan_restore(directory, target, transform=transform)
    assert not plan.ok
    return str(caught.value), plan


def test_a_transform_prefix_that_matches_no_target_leaf_is_refused(directory):
    message, plan = _refusal(directory, {"w": lambda a: a.T, "wq": lambda a: a})
    assert "transform {'wq': ...}: no target leaf is named 'wq' or under it" in message
    assert any("'wq'" in problem for problem in plan.problems)


def test_a_transform_that_raises_is_refused_naming_the_leaf_and_the_saved_tensor(directory):
    message, _ = _refusal(directory, {"w": lambda a: a.reshape(3, 3)})
    assert "'w': transforming saved 'w': the transform raised TypeError" in message
    assert "(8, 16) float32" in message


def test_a_transform_that_does_not_trace_is_refused_saying_why(directory):
    message, _ = _refusal(directory, {"w": lambda a: np.asarray(a).T})
    assert "'w': transforming saved 'w'" in message
    assert "jax.eval_shape" in message and "not np.asarray" in message


@pytest.mark.parametrize("returned", [None, ("pair", "of"), 3.0], ids=["none", "tuple", "float"])
def test_a_mapping_transform_returning_a_non_array_is_refused(directory, returned):
    message, _ = _refusal(directory, {"w": lambda a: returned})
    assert f"the transform returned {type(returned).__name__}, not an array" in message


def test_a_transform_returning_another_shape_than_its_evaluation_is_refused(directory):
    def only_on_numpy(array):
        return array.T if isinstance(array, np.ndarray) else array

    target = {"w": jnp.zeros((8, 16)), "qkv": jnp.zeros((4, 9))}
    assert plan_restore(directory, target, transform={"w": only_on_numpy}).ok
    with pytest.raises(ValueError, match=r"'w': from saved 'w': the transform returned "):
        restore_checkpoint(directory, target, transform={"w": only_on_numpy})


@pytest.mark.parametrize("bad", [3, {"w": 3}, {1: np.transpose}], ids=["int", "value", "key"])
@pytest.mark.usefixtures("without_type_checks")
def test_a_transform_of_the_wrong_kind_is_refused_before_reading(directory, bad):
    with pytest.raises(TypeError, match="restore_checkpoint: transform must"):
        restore_checkpoint(directory, {"w": jnp.zeros((8, 16))}, transform=bad)


def test_a_transform_with_target_none_is_refused(directory):
    with pytest.raises(ValueError, match="transform applies to a target's leaves"):
        restore_checkpoint(directory, None, transform={"w": np.transpose})


# ------------------------------------------------------------------------ permutation hint


def test_a_transposed_shape_says_so_and_suggests_the_transform(directory):
    target = {"w": jnp.zeros((16, 8), jnp.bfloat16), "qkv": jnp.zeros((4, 9))}
    suggestion = "transform={'w': lambda a: a.transpose(1, 0)}"
    with pytest.raises(ValueError) as caught:
        restore_checkpoint(directory, target, casting="same_kind")
    assert "'w': file has (8, 16) float32, target expects (16, 8) bfloat16" in str(caught.value)
    assert f"a permutation of the target's: {suggestion}" in str(caught.value)
    assert any(suggestion in p for p in plan_restore(directory, target).problems)


def test_the_suggested_permutation_restores_the_leaf(tmp_path):
    saved = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    checkpoints.save_checkpoint(tmp_path, {"x": saved}, 1)
    target = {"x": jnp.zeros((4, 2, 3))}
    problem = plan_restore(tmp_path, target).problems[0]
    suggestion = problem.split("transform=")[1].split(" would fit it")[0]
    restored = restore_checkpoint(tmp_path, target, transform=eval(suggestion))
    assert_trees_equal(restored["x"], np.moveaxis(saved, 2, 0).copy())


def test_a_shape_that_is_no_permutation_gets_no_transform_hint(directory):
    target = {"w": jnp.zeros((16, 16)), "qkv": jnp.zeros((4, 9))}
    (problem,) = plan_restore(directory, target).problems
    assert "permutation" not in problem and "transform" not in problem


def test_one_saved_tensor_fills_a_transformed_leaf_and_a_sharded_leaf_read_by_blocks(tmp_path):
    # On a `.shards` checkpoint the sharded `w` is read device block by device block, and
    # the transformed `wt` whole: both from the one saved tensor.
    checkpoints.save_checkpoint_multiprocess(tmp_path, {"w": KERNEL}, 1)
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("x",)), PartitionSpec("x"))
    target = {"w": jax.device_put(jnp.zeros((8, 16)), sharding), "wt": jnp.zeros((16, 8))}
    restored = restore_checkpoint(
        tmp_path, target, rename={"wt": "w"}, transform={"wt": lambda a: a.T}
    )
    assert restored["w"].sharding == sharding
    assert_trees_equal(restored, {"w": KERNEL, "wt": KERNEL.T.copy()})
