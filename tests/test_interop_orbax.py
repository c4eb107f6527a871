"""load_orbax_checkpoint: reads what flax's default save_checkpoint and orbax write, bit for
bit as orbax's own restore returns it, into nested dicts or into a target."""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from eqx_train import TrainState
from eqx_train.checkpoints import CheckpointFormatError
from eqx_train.interop import load_orbax_checkpoint
from tests.support.helpers import (
    SUPPORT,
    assert_identical,
    assert_trees_equal,
    free_port,
    run_processes,
    worker_env,
)
from tests.support.orbax_values import two_process_values

ocp = pytest.importorskip("orbax.checkpoint")

WORKER = os.path.join(SUPPORT, "orbax_worker.py")


def orbax_restore(path: Any) -> Any:
    """orbax's own restore of a PyTree checkpoint, arrays as NumPy (scalars, strings and
    empty values as orbax gives them)."""
    checkpointer = ocp.PyTreeCheckpointer()
    metadata = checkpointer.metadata(path).item_metadata.tree

    def args(leaf: Any) -> Any:
        is_array = isinstance(leaf, ocp.metadata.ArrayMetadata) and not isinstance(
            leaf, ocp.metadata.ScalarMetadata
        )
        return ocp.RestoreArgs(restore_type=np.ndarray) if is_array else ocp.RestoreArgs()

    return checkpointer.restore(path, restore_args=jax.tree.map(args, metadata))


def every_dtype() -> dict[str, Any]:
    """One array of each dtype a model state holds, with values that show bit errors."""
    base = np.array([0.0, -0.0, 1.5, -2.25, np.inf, np.nan, 3e-3, 65504.0])
    return {
        "float32": jnp.asarray(base, jnp.float32),
        "bfloat16": jnp.asarray(base, jnp.bfloat16),
        "float16": jnp.asarray(base, jnp.float16),
        "float8_e4m3fn": np.asarray(base[:4], ml_dtypes.float8_e4m3fn),
        "float8_e5m2": np.asarray(base[:4], ml_dtypes.float8_e5m2),
        "int8": jnp.arange(-4, 4, dtype=jnp.int8),
        "uint8": np.arange(250, 256, dtype=np.uint8),
        "int32": jnp.arange(6, dtype=jnp.int32).reshape(2, 3) - 3,
        "uint32": jax.random.key_data(jax.random.key(3)),
        "int64": np.array([-(2**62), 2**62 + 1]),
        "float64": np.array([np.pi, -0.0, 1e-300]),
        "complex64": np.array([1 + 2j, -0.5j], np.complex64),
        "bool": jnp.array([True, False, True]),
    }


# ------------------------------------------------------------------------ what flax writes


def test_reads_flax_default_save_checkpoint_bit_for_bit_as_orbax_restores_it(tmp_path):
    import flax
    from flax.training import checkpoints

    assert flax.config.flax_use_orbax_checkpointing  # flax 0.12's default: Orbax
    tree = {
        "params": {"Dense_0": {"kernel": jnp.ones((3, 2)) / 3, "bias": jnp.zeros(2)}},
        "dtypes": every_dtype(),
        "step": 12,
        "lr": 0.25,
        "layers": [np.int8(1), np.arange(3, dtype=np.uint16)],
        "note": "hello",
        "nothing": None,
        "empty": {},
    }
    path = checkpoints.save_checkpoint(tmp_path, tree, step=12)
    assert os.path.isdir(path) and os.path.basename(path) == "checkpoint_12"
    ours = load_orbax_checkpoint(path)
    assert_identical(ours, orbax_restore(path))
    # And against the values saved, independently of orbax.
    assert ours["step"] == 12 and ours["note"] == "hello" and ours["nothing"] is None
    assert ours["dtypes"]["bfloat16"].dtype == ml_dtypes.bfloat16
    assert_trees_equal(ours["dtypes"], jax.tree.map(np.asarray, tree["dtypes"]))
    # The run directory stands for its latest step.
    checkpoints.save_checkpoint(tmp_path, {"w": jnp.arange(3.0)}, step=13)
    assert_identical(load_orbax_checkpoint(tmp_path), {"w": np.arange(3.0, dtype=np.float32)})


def test_reads_flax_train_state_into_nested_dicts_named_as_flax_names_them(tmp_path):
    from flax.training import checkpoints, train_state

    state = train_state.TrainState.create(
        apply_fn=None,
        params={"Dense_0": {"kernel": jnp.arange(6.0).reshape(3, 2)}},
        tx=optax.adam(1e-3),
    )
    path = checkpoints.save_checkpoint(tmp_path, state, step=0)
    ours = load_orbax_checkpoint(path)
    assert_identical(ours, orbax_restore(path))
    assert set(ours) == {"step", "params", "opt_state"}
    mu = ours["opt_state"][0]["mu"]["Dense_0"]["kernel"]
    assert mu.shape == (3, 2) and not mu.any()


# ------------------------------------------------------------- orbax's CheckpointManager


def _two_items(directory: Any, *, ocdbt: bool = True, zarr3: bool = False) -> dict[str, Any]:
    mesh = jax.make_mesh((8,), ("x",))
    rows = NamedSharding(mesh, P("x"))
    state = {
        "w": jax.device_put(jnp.arange(64 * 4, dtype=jnp.float32).reshape(64, 4) / 7, rows),
        "b": jax.device_put(jnp.arange(16, dtype=jnp.bfloat16) - 8, rows),
        "replicated": jax.device_put(jnp.array([1.5, -0.0]), NamedSharding(mesh, P())),
        "pair": (jnp.ones(3, jnp.int32), 2.5),
    }
    extra = {"data_position": np.int64(1234), "keys": jax.random.key_data(jax.random.key(1))}

    def handler() -> Any:
        return ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=zarr3)

    with ocp.CheckpointManager(
        directory, item_handlers={"state": handler(), "extra": handler()}
    ) as manager:
        manager.save(
            5,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(state), extra=ocp.args.PyTreeSave(extra)
            ),
        )
    return {"state": state, "extra": extra}


@pytest.mark.parametrize(
    "ocdbt, zarr3", [(True, False), (False, False), (True, True), (False, True)]
)
def test_reads_checkpoint_manager_items_sharded_over_8_devices_bit_for_bit(tmp_path, ocdbt, zarr3):
    saved = _two_items(tmp_path, ocdbt=ocdbt, zarr3=zarr3)
    step = tmp_path / "5"
    assert os.path.isdir(step / "state") and os.path.isdir(step / "extra")
    if ocdbt:
        assert os.path.isfile(step / "state" / "manifest.ocdbt")
    else:
        assert os.path.isdir(step / "state" / "w")
    for item in ("state", "extra"):
        ours = load_orbax_checkpoint(step, item=item)
        assert_identical(ours, orbax_restore(step / item))
        # The run directory and the item directory itself name the same checkpoint.
        assert_identical(load_orbax_checkpoint(tmp_path, item=item), ours)
        assert_identical(load_orbax_checkpoint(step / item), ours)
    state = load_orbax_checkpoint(step, item="state")
    np.testing.assert_array_equal(state["w"], np.asarray(saved["state"]["w"]))
    assert state["pair"][1] == 2.5


def test_restores_into_a_target_onto_its_shardings(tmp_path):
    saved = _two_items(tmp_path)["state"]
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    other = NamedSharding(mesh, P("b", "a"))  # not the sharding it was saved with
    target = {
        "w": jax.device_put(jnp.zeros((64, 4)), other),
        "b": jax.ShapeDtypeStruct((16,), jnp.bfloat16, sharding=NamedSharding(mesh, P("a"))),
        "replicated": np.zeros(2, np.float32),
        "pair": (jnp.zeros(3, jnp.int32), 0.0),
    }
    restored = load_orbax_checkpoint(tmp_path / "5", target, item="state")
    assert restored["w"].sharding == other
    assert restored["b"].sharding == NamedSharding(mesh, P("a"))
    assert isinstance(restored["replicated"], np.ndarray)
    assert isinstance(restored["pair"], tuple) and restored["pair"][1] == 2.5
    assert_trees_equal(jax.tree.map(np.asarray, restored), jax.tree.map(np.asarray, saved))


def test_restores_an_equinox_model_and_a_train_state_saved_by_orbax(tmp_path):
    model, tx = eqx.nn.MLP(3, 2, 4, 2, key=jax.random.key(0)), optax.adam(1e-2)
    state = TrainState.create(model=model, tx=tx).apply_gradients(
        grads=jax.tree.map(jnp.ones_like, eqx.filter(model, eqx.is_array))
    )
    arrays = eqx.filter(state, eqx.is_array)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "state", arrays)
    fresh = TrainState.create(model=eqx.nn.MLP(3, 2, 4, 2, key=jax.random.key(9)), tx=tx)
    restored = load_orbax_checkpoint(tmp_path / "state", fresh)
    assert int(restored.step) == 1
    assert_trees_equal(eqx.filter(restored, eqx.is_array), arrays)
    # The model alone, from the same checkpoint's subtree names, is a mismatch: named.
    with pytest.raises(ValueError, match=r"'layers\.0\.weight': missing from the file"):
        load_orbax_checkpoint(tmp_path / "state", model)


def test_mismatched_target_names_the_leaf_path_and_both_shapes(tmp_path):
    _two_items(tmp_path)
    target = {"w": jnp.zeros((64, 5)), "b": jnp.zeros(16, jnp.bfloat16)}
    with pytest.raises(ValueError) as raised:
        load_orbax_checkpoint(tmp_path / "5", target, item="state")
    message = str(raised.value)
    assert "'w': file has (64, 4) float32, target expects (64, 5) float32" in message
    assert "'pair.0': in the file as (3,) int32, not in the target" in message
    assert str(tmp_path / "5" / "state") in message


def test_several_items_without_item_is_refused_listing_the_items(tmp_path):
    _two_items(tmp_path)
    with pytest.raises(ValueError, match=r"several items \(extra, state\); choose one"):
        load_orbax_checkpoint(tmp_path / "5")
    with pytest.raises(ValueError, match=r"no item 'params'; its items are extra, state"):
        load_orbax_checkpoint(tmp_path / "5", item="params")
    with pytest.raises(ValueError, match="single PyTree checkpoint"):
        load_orbax_checkpoint(tmp_path / "5" / "state", item="state")


def test_a_single_default_item_needs_no_item_name(tmp_path):
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(1, args=ocp.args.StandardSave({"a": jnp.arange(4)}))
        manager.save(2, args=ocp.args.StandardSave({"a": jnp.arange(4) * 2}))
    assert_identical(load_orbax_checkpoint(tmp_path), {"a": np.arange(4, dtype=np.int32) * 2})
    assert_identical(load_orbax_checkpoint(tmp_path / "1"), {"a": np.arange(4, dtype=np.int32)})


@pytest.mark.slow
def test_reads_a_two_process_orbax_save_bit_for_bit(tmp_path):
    port = str(free_port())
    env = worker_env()
    results = run_processes(
        [([sys.executable, WORKER, str(i), "2", port, str(tmp_path)], env) for i in range(2)],
        120,
    )
    for i, (code, out) in enumerate(results):
        assert f"OK orbax_save {i}" in out, f"process {i} exited {code}:\n{out[-3000:]}"
    # Each process wrote its own OCDBT database, merged under the checkpoint's manifest.
    item = tmp_path / "7" / "default"
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(os.listdir(item))
    ours = load_orbax_checkpoint(tmp_path)
    assert_identical(ours, orbax_restore(item))
    assert ours["step"] == 7
    assert_trees_equal({k: v for k, v in ours.items() if k != "step"}, two_process_values())


# ------------------------------------------------------------------------ hostile inputs


def _flax_save(tmp_path: Any) -> str:
    from flax.training import checkpoints

    return checkpoints.save_checkpoint(tmp_path, {"w": jnp.arange(4.0)}, step=1)


@pytest.mark.parametrize(
    "content, why",
    [
        (b"{not json", "is not valid JSON"),
        (b"", "is not valid JSON"),
        (b"[1, 2]", "'tree_metadata' object"),
        (b'{"tree_metadata": {"x": 3}}', "is not an object"),
        (
            b'{"tree_metadata": {"x": {"key_metadata": [{"key": "w", "key_type": 7}], '
            b'"value_metadata": {"value_type": "jax.Array"}}}}',
            "key_type",
        ),
        (
            b'{"tree_metadata": {"x": {"key_metadata": [{"key": "w", "key_type": 2}], '
            b'"value_metadata": {"value_type": "my.Custom"}}}}',
            "custom TypeHandler",
        ),
    ],
)
def test_corrupt_metadata_is_refused_naming_the_file(tmp_path, content, why):
    path = _flax_save(tmp_path)
    with open(os.path.join(path, "_METADATA"), "wb") as f:
        f.write(content)
    with pytest.raises(CheckpointFormatError, match=why) as raised:
        load_orbax_checkpoint(path)
    assert os.path.join(path, "_METADATA") in str(raised.value)


def test_missing_metadata_is_refused_naming_the_directory(tmp_path):
    path = _flax_save(tmp_path)
    os.remove(os.path.join(path, "_METADATA"))
    with pytest.raises(CheckpointFormatError, match="has no _METADATA file") as raised:
        load_orbax_checkpoint(path)
    assert path in str(raised.value)


def test_missing_array_data_is_refused_naming_the_array(tmp_path):
    path = _flax_save(tmp_path)
    for sub in ("d", "ocdbt.process_0"):
        shutil.rmtree(os.path.join(path, sub))
    with pytest.raises(CheckpointFormatError, match=r"array 'w' cannot be opened") as raised:
        load_orbax_checkpoint(path)
    assert path in str(raised.value)


def test_array_names_that_leave_the_directory_are_refused(tmp_path):
    (tmp_path / "outside").mkdir()
    inside = tmp_path / "ckpt"
    ocp.PyTreeCheckpointer().save(
        inside, {"w": np.arange(3.0)}, save_args={"w": ocp.SaveArgs()}, force=True
    )
    metadata = json.loads((inside / "_METADATA").read_text())
    metadata["use_ocdbt"] = False
    entry = metadata["tree_metadata"].pop("('w',)")
    entry["key_metadata"] = [{"key": "../outside", "key_type": 2}]
    metadata["tree_metadata"]["('../outside',)"] = entry
    (inside / "_METADATA").write_text(json.dumps(metadata))
    with pytest.raises(CheckpointFormatError, match="not a plain name"):
        load_orbax_checkpoint(inside)


def test_a_directory_that_is_not_orbax_is_refused_naming_it(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README").write_text("hi")
    with pytest.raises(CheckpointFormatError, match="is not an Orbax checkpoint") as raised:
        load_orbax_checkpoint(tmp_path / "notes")
    assert str(tmp_path / "notes") in str(raised.value)
    with pytest.raises(FileNotFoundError, match="nope"):
        load_orbax_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointFormatError, match="load_flax_checkpoint"):
        load_orbax_checkpoint(tmp_path / "notes" / "README")


def test_an_unfinished_save_is_refused_and_skipped(tmp_path):
    path = _flax_save(tmp_path)
    unfinished = tmp_path / "checkpoint_2.orbax-checkpoint-tmp-123"
    shutil.copytree(path, unfinished)
    with pytest.raises(CheckpointFormatError, match="unfinished Orbax save"):
        load_orbax_checkpoint(unfinished)
    assert_identical(load_orbax_checkpoint(tmp_path), {"w": np.arange(4.0, dtype=np.float32)})


def test_without_tensorstore_the_error_names_the_extra(tmp_path, monkeypatch):
    path = _flax_save(tmp_path)
    monkeypatch.setitem(sys.modules, "tensorstore", None)
    with pytest.raises(ImportError, match=r"pip install 'eqx_train\[orbax\]'"):
        load_orbax_checkpoint(path)


def _plain_checkpoint(tmp_path: Any) -> Any:
    """An orbax checkpoint in the plain layout (a zarr directory per array), and the
    contents of its array's `.zarray`."""
    path = tmp_path / "plain"
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)).save(path, {"w": np.arange(3.0)})
    return path, json.loads((path / "w" / ".zarray").read_text())


@pytest.mark.parametrize(
    "dtype, why", [("|S4", "unsupported dtype"), ("|V4", "unsupported dtype"), ("|O", "opened")]
)
def test_non_numeric_array_dtypes_are_refused(tmp_path, dtype, why):
    path, zarray = _plain_checkpoint(tmp_path)
    (path / "w" / ".zarray").write_text(json.dumps({**zarray, "dtype": dtype}))
    with pytest.raises(CheckpointFormatError, match=why):
        load_orbax_checkpoint(path)


def test_an_array_larger_than_memory_is_refused_before_anything_is_allocated(tmp_path):
    # A tiny file may declare any shape; allocating it would abort the process.
    path, zarray = _plain_checkpoint(tmp_path)
    (path / "w" / ".zarray").write_text(json.dumps({**zarray, "shape": [2**50], "chunks": [1]}))
    with pytest.raises(CheckpointFormatError, match=r"array 'w' would take \d+ bytes, more"):
        load_orbax_checkpoint(path)


def test_a_metadata_file_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    path = _flax_save(tmp_path)
    os.remove(os.path.join(path, "_METADATA"))
    os.mkfifo(os.path.join(path, "_METADATA"))
    with pytest.raises(CheckpointFormatError, match="not a regular file"):
        load_orbax_checkpoint(path)


def test_load_flax_checkpoint_points_an_orbax_directory_to_load_orbax_checkpoint(tmp_path):
    from eqx_train.interop import load_flax_checkpoint

    path = _flax_save(tmp_path)
    with pytest.raises(CheckpointFormatError, match="load_orbax_checkpoint"):
        load_flax_checkpoint(path)
