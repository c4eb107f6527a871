"""checkpoints: the file, dtypes, ordering, retention, restore semantics, errors, async."""

import concurrent.futures
import json
import os
import pickle
import threading
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from safetensors import safe_open
from safetensors.numpy import load_file

from eqx_train import TrainState, checkpoints
from tests.support.helpers import assert_trees_equal, latest_path

# ---------------------------------------------------------------- the file


def test_file_is_named_prefix_step_safetensors_and_path_is_returned(tmp_path):
    path = checkpoints.save_checkpoint(tmp_path, {"a": np.ones(2)}, 7, prefix="test_")
    assert path == os.path.join(tmp_path, "test_7.safetensors")
    assert os.listdir(tmp_path) == ["test_7.safetensors"]


def test_a_stranger_opens_it_with_safetensors_and_sees_dotted_key_paths(tmp_path):
    tx = optax.chain(optax.clip(1.0), optax.adam(1e-3))
    model = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))
    state = TrainState.create(model=model, tx=tx)
    target = {"params": {"dense": {"kernel": jnp.ones((2, 3))}}, "state": state}
    path = checkpoints.save_checkpoint(tmp_path, target, 1)
    tensors = load_file(path)
    assert "params.dense.kernel" in tensors
    assert "state.opt_state.1.0.mu.layers.0.weight" in tensors
    assert "state.model.layers.1.bias" in tensors
    np.testing.assert_array_equal(tensors["params.dense.kernel"], np.ones((2, 3)))


def test_metadata_records_format_version_step_and_tree(tmp_path):
    path = checkpoints.save_checkpoint(tmp_path, {"x": [np.ones(1), None]}, 0.5)
    with safe_open(path, "np") as f:
        meta = f.metadata()
    assert meta["eqx_train.format"] == "eqx_train.checkpoint"
    assert meta["eqx_train.format_version"] == "1"
    assert json.loads(meta["eqx_train.step"]) == 0.5
    assert json.loads(meta["eqx_train.tree"]) == {
        "dict": [["x", {"list": [{"tensor": "x.0", "kind": "array"}, None]}]]
    }


ALL_DTYPES = [
    jnp.bfloat16,
    np.float16,
    np.float32,
    np.float64,
    np.bool_,
    np.uint8,
    np.int8,
    np.int16,
    np.uint16,
    np.int32,
    np.uint32,
    np.int64,
    np.uint64,
]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_dtype_round_trips_bit_exactly_with_and_without_target(tmp_path, dtype):
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=32, dtype=np.uint8).tobytes()
    array = np.frombuffer(raw, dtype=dtype).reshape(2, -1)
    if np.dtype(dtype) == np.bool_:
        array = array.view(np.uint8) % 2 == 1
    tree = {"x": array, "empty": np.zeros((0, 3), dtype), "scalar": array.reshape(-1)[0]}
    checkpoints.save_checkpoint(tmp_path, tree, 1)
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, None), tree)
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, tree), tree)


def test_int64_keeps_its_dtype_in_32_bit_jax_mode(tmp_path):
    assert not jax.config.read("jax_enable_x64")
    big = np.array([2**40, -(2**62)], np.int64)
    checkpoints.save_checkpoint(tmp_path, {"big": big}, 1)
    restored = checkpoints.restore_checkpoint(tmp_path, None)["big"]
    assert restored.dtype == np.int64
    np.testing.assert_array_equal(restored, big)


def test_python_and_numpy_scalars_come_back_as_the_same_types(tmp_path):
    tree = {"i": 3, "f": 0.1, "b": True, "n": np.float32(2.5), "u": np.uint8(7), "s": "name"}
    checkpoints.save_checkpoint(tmp_path, tree, 1)
    for restored in (
        checkpoints.restore_checkpoint(tmp_path, None),
        checkpoints.restore_checkpoint(tmp_path, tree),
    ):
        assert restored == tree
        assert [type(restored[k]) for k in sorted(tree)] == [type(tree[k]) for k in sorted(tree)]


def test_typed_and_raw_prng_keys_round_trip(tmp_path):
    tree = {
        "typed": jax.random.key(42),
        "raw": jax.random.PRNGKey(42),
        "typed_batch": jax.random.split(jax.random.key(1), 3),
    }
    checkpoints.save_checkpoint(tmp_path, tree, 1)
    for target in (None, tree):
        restored: Any = checkpoints.restore_checkpoint(tmp_path, target)
        assert jnp.issubdtype(restored["typed"].dtype, jax.dtypes.prng_key)
        assert_trees_equal(restored["typed"], tree["typed"])
        assert_trees_equal(restored["typed_batch"], tree["typed_batch"])
        np.testing.assert_array_equal(restored["raw"], tree["raw"])
        assert restored["raw"].dtype == np.uint32


def test_target_none_rebuilds_containers_key_types_and_none(tmp_path):
    tree = {
        "ints": {3: np.ones(1), 10: np.zeros(1)},
        "t": (np.ones(2), [None, np.ones(1)]),
        "none": None,
    }
    checkpoints.save_checkpoint(tmp_path, tree, 1)
    restored = checkpoints.restore_checkpoint(tmp_path, None)
    assert_trees_equal(restored, tree)
    assert set(restored["ints"]) == {3, 10}
    assert isinstance(restored["t"], tuple) and isinstance(restored["t"][1], list)


def test_target_none_turns_modules_into_dicts_of_their_fields(tmp_path):
    model = eqx.nn.Linear(2, 3, key=jax.random.key(0))
    checkpoints.save_checkpoint(tmp_path, model, 1)
    restored = checkpoints.restore_checkpoint(tmp_path, None)
    assert set(restored) == {"weight", "bias"}
    np.testing.assert_array_equal(restored["weight"], model.weight)


def test_no_pickle_is_involved(tmp_path, monkeypatch):
    import ast
    import pathlib

    import eqx_train

    # Statically: no module of the package imports a pickling library, in any spelling.
    banned = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve"}
    for source in pathlib.Path(eqx_train.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not {n.split(".")[0] for n in names} & banned, f"{source}: {names}"

    # Dynamically: a save and both kinds of restore never call into pickle.
    def refuse(*args, **kwargs):
        raise AssertionError("pickle used")

    for name in ("loads", "dumps", "load", "dump", "Unpickler", "Pickler"):
        monkeypatch.setattr(pickle, name, refuse)
    tree = {"m": eqx.nn.Linear(2, 2, key=jax.random.key(0))}
    checkpoints.save_checkpoint(tmp_path, tree, 1)
    checkpoints.restore_checkpoint(tmp_path, tree)
    checkpoints.restore_checkpoint(tmp_path, None)


def test_unsupported_dtype_names_leaf(tmp_path):
    with pytest.raises(TypeError, match=r"leaf 'w\.c' has dtype datetime64\[s\]"):
        checkpoints.save_checkpoint(tmp_path, {"w": {"c": np.zeros(2, "datetime64[s]")}}, 1)
    assert os.listdir(tmp_path) == []


def test_dotted_key_collision_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"tensor name 'a\.b'"):
        checkpoints.save_checkpoint(tmp_path, {"a.b": np.ones(1), "a": {"b": np.ones(1)}}, 1)


# ---------------------------------------------------------------- ordering and listing


def _touch_steps(tmp_path, steps, prefix="checkpoint_"):
    for step in steps:
        checkpoints.save_checkpoint(
            tmp_path, {"s": np.asarray(step)}, step, prefix=prefix, keep=100
        )


def test_ordering_is_numeric_for_ints(tmp_path):
    _touch_steps(tmp_path, [1, 2, 9, 10])
    assert latest_path(tmp_path).endswith("checkpoint_10.safetensors")
    assert checkpoints.available_steps(tmp_path) == [1, 2, 9, 10]


def test_ordering_is_numeric_for_floats(tmp_path):
    _touch_steps(tmp_path, [0.0, 0.5, 1e5])
    # An integral float is spelled as the integer it equals: one step, one name.
    assert latest_path(tmp_path).endswith("checkpoint_100000.safetensors")
    assert checkpoints.available_steps(tmp_path, step_type=float) == [0.0, 0.5, 1e5]


def test_int_step_type_on_float_steps_says_use_float(tmp_path):
    _touch_steps(tmp_path, [0.5])
    with pytest.raises(ValueError, match="step_type=float"):
        checkpoints.available_steps(tmp_path)


def test_stray_files_are_ignored(tmp_path):
    _touch_steps(tmp_path, [3])
    for name in (
        "checkpoint_notes.txt",
        "checkpoint_tmp",
        "checkpoint_99",
        "other_100.safetensors",
        ".checkpoint_50.safetensors.tmp-1-abc",
        "checkpoint_7.safetensors.bak",
    ):
        (tmp_path / name).write_text("not a checkpoint")
    assert checkpoints.available_steps(tmp_path) == [3]
    assert latest_path(tmp_path).endswith("checkpoint_3.safetensors")
    checkpoints.save_checkpoint(tmp_path, {"s": np.asarray(4)}, 4, keep=1)
    assert checkpoints.available_steps(tmp_path) == [4]
    assert (tmp_path / "checkpoint_notes.txt").exists()


def test_latest_is_none_for_empty_or_missing_directory(tmp_path):
    assert checkpoints.latest_checkpoint(tmp_path) is None
    assert checkpoints.latest_checkpoint(tmp_path / "missing") is None
    assert checkpoints.available_steps(tmp_path / "missing") == []


# ---------------------------------------------------------------- retention and overwrite


def test_keep_retains_newest(tmp_path):
    for step in range(6):
        checkpoints.save_checkpoint(tmp_path, {"s": np.asarray(step)}, step, keep=2)
    assert checkpoints.available_steps(tmp_path) == [4, 5]


def test_keep_every_n_steps_keeps_flax_picks(tmp_path):
    for step in range(0, 12):
        checkpoints.save_checkpoint(
            tmp_path, {"s": np.asarray(step)}, step, keep=2, keep_every_n_steps=3
        )
    # flax's rule: among old files, from last_kept=-inf keep step s (s != 0) if
    # s - last_kept >= 3 -> 1, 4, 7; plus the newest two.
    assert checkpoints.available_steps(tmp_path) == [1, 4, 7, 10, 11]


def test_saving_an_older_or_equal_step_without_overwrite_fails(tmp_path):
    _touch_steps(tmp_path, [5])
    for step in (5, 3):
        with pytest.raises(ValueError, match=r"step 5 already exists.*overwrite=True"):
            checkpoints.save_checkpoint(tmp_path, {"s": np.asarray(0)}, step)
    assert checkpoints.available_steps(tmp_path) == [5]


def test_overwrite_replaces_and_removes_newer_steps(tmp_path):
    _touch_steps(tmp_path, [1, 2, 3, 4])
    checkpoints.save_checkpoint(tmp_path, {"s": np.asarray(-2)}, 2, overwrite=True, keep=10)
    assert checkpoints.available_steps(tmp_path) == [1, 2]
    assert checkpoints.restore_checkpoint(tmp_path, None)["s"] == -2


@pytest.mark.parametrize("keep", [0, -1])
def test_invalid_keep_is_rejected(tmp_path, keep):
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        checkpoints.save_checkpoint(tmp_path, {}, 1, keep=keep)
    assert os.listdir(tmp_path) == []


def test_non_int_keep_is_a_type_error(tmp_path, without_type_checks):
    with pytest.raises(TypeError, match="keep must be an int >= 1, got 1.5"):
        checkpoints.save_checkpoint(tmp_path, {}, 1, keep=1.5)  # pyright: ignore[reportArgumentType]  # a wrong value on purpose
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- restore


def test_restore_from_file_path_and_from_directory_with_step(tmp_path):
    _touch_steps(tmp_path, [1, 2])
    first = os.path.join(tmp_path, "checkpoint_1.safetensors")
    assert checkpoints.restore_checkpoint(first, None)["s"] == 1
    assert checkpoints.restore_checkpoint(tmp_path, None, step=1)["s"] == 1
    assert checkpoints.restore_checkpoint(tmp_path, None)["s"] == 2


def test_restore_missing_directory_returns_target_unchanged(tmp_path):
    target = {"a": np.ones(1)}
    assert checkpoints.restore_checkpoint(tmp_path / "nope", target) is target
    assert checkpoints.restore_checkpoint(tmp_path, target) is target


def test_restore_missing_step_names_available_steps(tmp_path):
    _touch_steps(tmp_path, [1, 5])
    with pytest.raises(
        ValueError, match=r"no checkpoint for step 3.*available steps: \['1', '5'\]"
    ):
        checkpoints.restore_checkpoint(tmp_path, None, step=3)


def test_restore_equinox_module_keeps_non_array_leaves_from_target(tmp_path):
    model = eqx.nn.MLP(2, 2, 4, 1, activation=jax.nn.gelu, key=jax.random.key(0))
    checkpoints.save_checkpoint(tmp_path, model, 1)
    blank = eqx.nn.MLP(2, 2, 4, 1, activation=jax.nn.gelu, key=jax.random.key(9))
    restored = checkpoints.restore_checkpoint(tmp_path, blank)
    assert restored.activation is jax.nn.gelu
    assert_trees_equal(eqx.filter(restored, eqx.is_array), eqx.filter(model, eqx.is_array))


def test_restore_train_state_round_trips(tmp_path):
    model = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))
    state = TrainState.create(model=model, tx=optax.adam(1e-3))
    grads = eqx.filter_grad(lambda m: jnp.sum(m(jnp.ones(2)) ** 2))(state.model)
    state = state.apply_gradients(grads=grads)
    checkpoints.save_checkpoint(tmp_path, state, int(state.step))
    fresh = TrainState.create(model=eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(5)), tx=state.tx)
    restored = checkpoints.restore_checkpoint(tmp_path, fresh)
    assert type(restored) is TrainState and int(restored.step) == 1
    assert_trees_equal(restored, state)


def test_restore_keeps_target_sharding(tmp_path):
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    value = jax.device_put(jnp.arange(16.0).reshape(8, 2), sharding)
    checkpoints.save_checkpoint(tmp_path, {"w": value}, 1)
    restored = checkpoints.restore_checkpoint(tmp_path, {"w": value})["w"]
    assert restored.sharding == sharding
    np.testing.assert_array_equal(restored, value)


def test_shape_dtype_struct_target_becomes_array_with_its_sharding(tmp_path):
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec(None, "data"))
    checkpoints.save_checkpoint(tmp_path, {"w": np.arange(16, dtype=np.float32).reshape(2, 8)}, 1)
    spec = jax.ShapeDtypeStruct((2, 8), jnp.float32, sharding=sharding)
    restored = checkpoints.restore_checkpoint(tmp_path, {"w": spec})["w"]
    assert isinstance(restored, jax.Array) and restored.sharding == sharding
    np.testing.assert_array_equal(restored, np.arange(16).reshape(2, 8))


def test_shape_mismatch_error_names_path_file_and_both_sides(tmp_path):
    path = checkpoints.save_checkpoint(tmp_path, {"a": {"w": np.ones((2, 3), np.float32)}}, 1)
    with pytest.raises(ValueError) as info:
        checkpoints.restore_checkpoint(tmp_path, {"a": {"w": np.ones((3, 3), np.float32)}})
    message = str(info.value)
    assert path in message
    assert "'a.w': file has (2, 3) float32, target expects (3, 3) float32" in message


def test_dtype_mismatch_is_an_error(tmp_path):
    checkpoints.save_checkpoint(tmp_path, {"w": np.ones(2, np.float32)}, 1)
    with pytest.raises(
        ValueError,
        match=r"'w': file has \(2,\) float32, target expects \(2,\) "
        r"bfloat16",
    ):
        checkpoints.restore_checkpoint(tmp_path, {"w": jnp.ones(2, jnp.bfloat16)})


def test_missing_and_extra_keys_are_listed_in_one_error(tmp_path):
    checkpoints.save_checkpoint(tmp_path, {"old": np.ones(1), "same": np.ones(1)}, 1)
    with pytest.raises(ValueError) as info:
        checkpoints.restore_checkpoint(tmp_path, {"new": np.ones(1), "same": np.ones(1)})
    message = str(info.value)
    assert "'new': missing from the file, target expects (1,) float64" in message
    assert "'old': in the file as (1,) float64, not in the target" in message
    assert "strict=False" in message


def test_partial_restore_is_opt_in(tmp_path):
    checkpoints.save_checkpoint(tmp_path, {"old": np.ones(1), "same": np.full(1, 7.0)}, 1)
    target = {"new": np.zeros(1), "same": np.ones(1)}
    with pytest.warns(checkpoints.PartialRestoreWarning, match=r"'new'[\s\S]*'old'"):
        restored = checkpoints.restore_checkpoint(tmp_path, target, strict=False)
    np.testing.assert_array_equal(restored["same"], [7.0])
    assert restored["new"] is target["new"]


def test_restoring_one_leaf_reads_only_its_bytes(tmp_path, monkeypatch):
    big = {f"w{i}": np.full((256, 1024), i, np.float32) for i in range(8)}  # 8 MiB
    checkpoints.save_checkpoint(tmp_path, big, 1)
    read_bytes = []
    real_preadv = os.preadv

    def counting_preadv(fd, buffers, offset):
        count = real_preadv(fd, buffers, offset)
        read_bytes.append(count)
        return count

    monkeypatch.setattr(os, "preadv", counting_preadv)
    with pytest.warns(checkpoints.PartialRestoreWarning, match="7 saved tensors went unused"):
        restored = checkpoints.restore_checkpoint(
            tmp_path, {"w3": np.zeros((256, 1024), np.float32)}, strict=False
        )
    np.testing.assert_array_equal(restored["w3"], big["w3"])
    with open(latest_path(tmp_path), "rb") as f:
        header_bytes = 8 + int.from_bytes(f.read(8), "little")
    assert sum(read_bytes) == header_bytes + 256 * 1024 * 4


# ---------------------------------------------------------------- corrupt files and disk full


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x01\x02\x03",
        (10**15).to_bytes(8, "little") + b"{}",
        b"\x10" + b"\x00" * 7 + b"x" * 16,
        (20).to_bytes(8, "little") + b'{"a":{"dtype":"F32",',
    ],
    ids=["zero-length", "short", "absurd-header-size", "garbage-json", "truncated-header"],
)
def test_corrupt_files_raise_clear_error_naming_file(tmp_path, content):
    path = tmp_path / "checkpoint_1.safetensors"
    path.write_bytes(content)
    with pytest.raises(checkpoints.CheckpointFormatError, match=str(path)):
        checkpoints.restore_checkpoint(tmp_path, None)


def test_truncated_data_section_is_detected_before_reading(tmp_path):
    path = checkpoints.save_checkpoint(tmp_path, {"w": np.ones((100, 100), np.float32)}, 1)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(checkpoints.CheckpointFormatError, match="claims bytes"):
        checkpoints.restore_checkpoint(path, None)


def test_absurd_tensor_size_is_rejected_without_allocating(tmp_path):
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [10**9, 10**9], "data_offsets": [0, 4 * 10**18]}}
    ).encode()
    path = tmp_path / "checkpoint_1.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(checkpoints.CheckpointFormatError, match="claims bytes"):
        checkpoints.restore_checkpoint(tmp_path, None)


def test_disk_full_leaves_previous_checkpoints_and_no_temporary_files(tmp_path, monkeypatch):
    checkpoints.save_checkpoint(tmp_path, {"w": np.ones(1000)}, 1)
    before = sorted(os.listdir(tmp_path))
    real_write = os.write
    budget = [4000]

    def filling_write(fd, data):
        # Like a filling disk: a short write first, then ENOSPC.
        if budget[0] <= 0:
            raise OSError(28, "No space left on device")
        count = real_write(fd, data[: budget[0]])
        budget[0] -= count
        return count

    monkeypatch.setattr(os, "write", filling_write)
    with pytest.raises(OSError, match="No space left"):
        checkpoints.save_checkpoint(tmp_path, {"w": np.ones(10000)}, 2)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == before
    np.testing.assert_array_equal(
        checkpoints.restore_checkpoint(tmp_path, None)["w"], np.ones(1000)
    )


# ---------------------------------------------------------------- async


def test_async_save_snapshots_numpy_state_at_call(tmp_path):
    manager = checkpoints.AsyncManager()
    array = np.zeros(1_000_000)
    checkpoints.save_checkpoint(tmp_path, {"a": array}, 1, async_manager=manager)
    array[:] = 1.0
    manager.wait_previous_save()
    np.testing.assert_array_equal(checkpoints.restore_checkpoint(tmp_path, None)["a"], 0.0)


def test_async_save_is_immune_to_buffer_donation(tmp_path):
    manager = checkpoints.AsyncManager()
    state = {"a": jnp.arange(1000.0)}
    checkpoints.save_checkpoint(tmp_path, state, 1, async_manager=manager)
    donated = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)(state)
    manager.wait_previous_save()
    assert state["a"].is_deleted()
    np.testing.assert_array_equal(
        checkpoints.restore_checkpoint(tmp_path, None)["a"], np.arange(1000.0)
    )
    np.testing.assert_array_equal(donated["a"], np.arange(1000.0) + 1)


def test_async_saves_run_in_order_and_apply_retention(tmp_path):
    manager = checkpoints.AsyncManager()
    for step in range(5):
        checkpoints.save_checkpoint(
            tmp_path, {"s": np.asarray(step)}, step, keep=2, async_manager=manager
        )
    manager.wait_previous_save()
    assert checkpoints.available_steps(tmp_path) == [3, 4]


def test_async_error_is_raised_at_wait(tmp_path, monkeypatch):
    manager = checkpoints.AsyncManager()

    def broken_write(fd, data):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "write", broken_write)
    checkpoints.save_checkpoint(tmp_path, {"a": np.ones(3)}, 1, async_manager=manager)
    with pytest.raises(OSError, match="Input/output error"):
        manager.wait_previous_save()
    assert checkpoints.available_steps(tmp_path) == []


def test_async_error_is_raised_at_next_save(tmp_path, monkeypatch):
    manager = checkpoints.AsyncManager()
    failed = threading.Event()

    def broken_write(fd, data):
        failed.set()
        raise OSError(5, "EIO")

    monkeypatch.setattr(os, "write", broken_write)
    checkpoints.save_checkpoint(tmp_path, {"a": np.ones(3)}, 1, async_manager=manager)
    assert failed.wait(timeout=30)
    # Once the failed save has ended (a save still being written would have the next one
    # queued behind it, and its error raised at the save or wait after), as in flax:
    future = manager.save_future
    assert future is not None  # the failed save's
    concurrent.futures.wait([future], timeout=30)
    monkeypatch.undo()
    with pytest.raises(OSError, match="EIO"):
        checkpoints.save_checkpoint(tmp_path, {"a": np.ones(3)}, 2, async_manager=manager)
    checkpoints.save_checkpoint(tmp_path, {"a": np.ones(3)}, 2, async_manager=manager)
    manager.wait_previous_save()
    assert checkpoints.available_steps(tmp_path) == [2]


# ---------------------------------------------------------------- convert_pre_linen


def test_convert_pre_linen_matches_flax():
    from flax.training import checkpoints as flax_checkpoints

    params = {
        "Conv_0": {"kernel": 1},
        "Dense_1": {"kernel": 2},
        "Dense_10": {"kernel": 3},
        "Dense_2": {"Dense_5": {"bias": 4}, "Conv_3": 5},
        "LayerNorm_4": 6,
        "head": 7,
    }
    ours = checkpoints.convert_pre_linen(params)
    assert ours == flax_checkpoints.convert_pre_linen(params)
    assert set(ours) == {"Conv_0", "Dense_0", "Dense_1", "Dense_2", "LayerNorm_0", "head"}
    assert ours["Dense_2"] == {"kernel": 3}
    assert checkpoints.convert_pre_linen(ours) == ours
