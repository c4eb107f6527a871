"""The Hugging Face sharded layout: save_sharded / load_sharded."""

import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from huggingface_hub import split_state_dict_into_shards_factory

from eqx_train.checkpoints import (
    CheckpointFormatError,
    PartialRestoreWarning,
    restore_checkpoint,
)
from eqx_train.interop import load_sharded, save_sharded
from tests.support.helpers import assert_trees_equal

INDEX = "model.safetensors.index.json"


def _tree():
    return {
        "embed": {"weight": np.arange(64, dtype=np.float32).reshape(16, 4)},
        "layers": [
            {"weight": np.full((8, 8), 0.5, np.float32), "bias": jnp.ones(8, jnp.bfloat16)},
            {"weight": np.full((8, 8), -1.5, np.float32), "bias": jnp.zeros(8, jnp.bfloat16)},
        ],
        "scale": np.float16(2.0),
    }


def _index(directory):
    with open(os.path.join(directory, INDEX)) as f:
        return json.load(f)


def test_small_max_shard_size_makes_several_files_whose_index_lists_every_tensor_once(tmp_path):
    save_sharded(tmp_path, _tree(), max_shard_size=300)
    index = _index(tmp_path)
    shards = sorted(p for p in os.listdir(tmp_path) if p.startswith("model-"))
    assert len(shards) == 3
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    names = ["embed.weight", "layers.0.bias", "layers.0.weight", "layers.1.bias"]
    names += ["layers.1.weight", "scale"]
    assert sorted(index["weight_map"]) == names
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == 256 + 2 * (256 + 16) + 2
    for shard in shards:
        with safetensors.safe_open(str(tmp_path / shard), "np") as f:
            assert f.metadata()["format"] == "pt"
            assert sorted(f.keys()) == sorted(
                n for n, file in index["weight_map"].items() if file == shard
            )
    assert not os.path.exists(tmp_path / "model.safetensors")


def test_shards_follow_huggingface_hubs_split(tmp_path):
    tree = {f"t{i}": np.zeros(n, np.uint8) for i, n in enumerate([60, 60, 20, 150, 20, 20])}
    save_sharded(tmp_path, tree, max_shard_size=100)
    split = split_state_dict_into_shards_factory(
        tree,
        get_storage_size=lambda a: a.nbytes,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=100,
    )
    assert _index(tmp_path)["weight_map"] == split.tensor_to_filename


def test_everything_in_one_shard_is_a_single_model_safetensors_without_index(tmp_path):
    save_sharded(tmp_path, _tree())
    assert os.listdir(tmp_path) == ["model.safetensors"]
    assert_trees_equal(restore_checkpoint(tmp_path / "model.safetensors", None), _tree())


@pytest.mark.parametrize("max_shard_size", [300, "5GB", "0.3KB"])
def test_load_without_target_restores_the_tree_bit_exactly(tmp_path, max_shard_size):
    save_sharded(tmp_path, _tree(), max_shard_size=max_shard_size)
    assert_trees_equal(load_sharded(tmp_path), _tree())


def test_load_into_an_equinox_model_target(tmp_path):
    model = eqx.nn.MLP(4, 3, 16, 2, key=jax.random.key(0))
    save_sharded(tmp_path, model, max_shard_size="200B")
    assert len(os.listdir(tmp_path)) > 2
    blank = jax.tree.map(lambda x: jnp.zeros_like(x) if eqx.is_array(x) else x, model)
    assert_trees_equal(load_sharded(tmp_path, blank), model)


def test_load_keeps_the_targets_sharding(tmp_path):
    mesh = jax.make_mesh((8,), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    save_sharded(tmp_path, {"w": np.arange(16.0, dtype=np.float32)}, max_shard_size=8)
    target = {"w": jax.ShapeDtypeStruct((16,), jnp.float32, sharding=sharding)}
    loaded = load_sharded(tmp_path, target)
    assert loaded["w"].sharding == sharding
    np.testing.assert_array_equal(loaded["w"], np.arange(16.0))


def test_mismatch_with_target_is_listed_like_restore_checkpoint(tmp_path):
    save_sharded(tmp_path, {"a": np.zeros(3, np.float32), "b": np.zeros(2)}, max_shard_size=8)
    with pytest.raises(ValueError, match=r"load_sharded: .* does not match") as info:
        load_sharded(tmp_path, {"a": np.zeros(4, np.float32), "c": np.zeros(1)})
    text = str(info.value)
    assert "'a': file has (3,) float32" in text and "'c': missing" in text and "'b'" in text
    with pytest.warns(PartialRestoreWarning, match=r"load_sharded: [\s\S]*'a'"):
        loaded = load_sharded(tmp_path, {"b": np.ones(2)}, strict=False)
    np.testing.assert_array_equal(loaded["b"], np.zeros(2))


def test_a_layout_written_by_huggingface_hubs_splitter_loads(tmp_path):
    state = {
        "model.embed.weight": np.random.default_rng(0).normal(size=(10, 4)).astype(np.float32),
        "model.layers.0.weight": np.ones((4, 4), np.float16),
        "model.layers.0.bias": np.arange(4, dtype=np.int64),
        "lm_head.weight": np.full((4, 10), 3.0, np.float32),
    }
    split = split_state_dict_into_shards_factory(
        state,
        get_storage_size=lambda a: a.nbytes,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=100,
    )
    assert split.is_sharded
    for file, names in split.filename_to_tensors.items():
        safetensors.numpy.save_file(
            {n: state[n] for n in names}, str(tmp_path / file), metadata={"format": "pt"}
        )
    with open(tmp_path / INDEX, "w") as f:
        json.dump({"metadata": split.metadata, "weight_map": split.tensor_to_filename}, f)
    nested = load_sharded(tmp_path)
    assert_trees_equal(
        nested,
        {
            "model": {
                "embed": {"weight": state["model.embed.weight"]},
                "layers": {
                    "0": {
                        "weight": state["model.layers.0.weight"],
                        "bias": state["model.layers.0.bias"],
                    }
                },
            },
            "lm_head": {"weight": state["lm_head.weight"]},
        },
    )
    target = {"model.layers.0.bias": np.zeros(4, np.int64)}
    with pytest.warns(PartialRestoreWarning, match="'lm_head.weight'"):
        partial = load_sharded(tmp_path, target, strict=False)
    np.testing.assert_array_equal(partial["model.layers.0.bias"], np.arange(4))


def test_names_that_do_not_nest_come_back_flat(tmp_path):
    safetensors.numpy.save_file(
        {"a": np.zeros(1), "a.b": np.ones(1)}, str(tmp_path / "model.safetensors")
    )
    assert set(load_sharded(tmp_path)) == {"a", "a.b"}


@pytest.mark.parametrize("bad", [0, -5, "5", "5 parsecs", "GB", "1e3GB", "five MB"])
def test_bad_max_shard_size_is_a_value_error_naming_it(tmp_path, bad):
    with pytest.raises(ValueError, match="max_shard_size"):
        save_sharded(tmp_path, _tree(), max_shard_size=bad)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("size", "shards"), [("1KiB", 1), ("0.3KiB", 3), ("0.25KiB", 6), (" 300 b ", 3), ("1kb", 1)]
)
def test_max_shard_size_units(tmp_path, size, shards):
    save_sharded(tmp_path, _tree(), max_shard_size=size)
    names = [p for p in os.listdir(tmp_path) if p.endswith(".safetensors")]
    assert len(names) == shards


def test_a_tensor_bigger_than_a_shard_gets_one_of_its_own(tmp_path):
    tree = {
        "a": np.zeros(10, np.uint8),
        "big": np.zeros(1000, np.uint8),
        "c": np.zeros(10, np.uint8),
    }
    save_sharded(tmp_path, tree, max_shard_size=100)
    weight_map = _index(tmp_path)["weight_map"]
    assert weight_map["a"] == weight_map["c"] != weight_map["big"]
    assert_trees_equal(load_sharded(tmp_path), tree)


def test_unsavable_leaves_are_refused_naming_the_path_before_writing(tmp_path):
    with pytest.raises(TypeError, match="'w'"):
        save_sharded(tmp_path, {"w": np.zeros(2, "datetime64[s]")})
    assert os.listdir(tmp_path) == []


def test_a_new_save_removes_the_previous_saves_files_after_its_index(tmp_path):
    save_sharded(tmp_path, _tree(), max_shard_size=100)
    assert len(os.listdir(tmp_path)) > 4
    save_sharded(tmp_path, _tree(), max_shard_size=300)
    assert sorted(os.listdir(tmp_path)) == [
        *(f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)),
        INDEX,
    ]
    save_sharded(tmp_path, {"x": np.zeros(2)})
    assert os.listdir(tmp_path) == ["model.safetensors"]
    (tmp_path / "notes.txt").write_text("mine")
    save_sharded(tmp_path, _tree(), max_shard_size=300)
    assert "notes.txt" in os.listdir(tmp_path) and "model.safetensors" not in os.listdir(tmp_path)
    assert_trees_equal(load_sharded(tmp_path), _tree())


def test_a_crash_before_the_index_leaves_the_previous_save(tmp_path, monkeypatch):
    old = {"w": np.zeros(64, np.float32), "v": np.zeros(64, np.float32)}
    save_sharded(tmp_path, old, max_shard_size=256)
    from eqx_train.checkpoints.storage import _local

    real = _local.LocalStorage.atomic_write

    def crash_on_index(self, path, write, **kwargs):
        if path.endswith(INDEX):
            raise KeyboardInterrupt("killed before the index")
        return real(self, path, write, **kwargs)

    monkeypatch.setattr(_local.LocalStorage, "atomic_write", crash_on_index)
    new = {"a": np.ones(64, np.float32), "b": np.ones(64, np.float32), "c": np.ones(4)}
    with pytest.raises(KeyboardInterrupt):
        save_sharded(tmp_path, new, max_shard_size=256)
    monkeypatch.undo()
    # The new save wrote model-0000k-of-00003 files, but the index still names the old ones.
    assert os.path.exists(tmp_path / "model-00001-of-00003.safetensors")
    assert_trees_equal(load_sharded(tmp_path), old)


def test_shards_of_another_save_under_the_same_names_are_refused_not_mixed(tmp_path):
    save_sharded(
        tmp_path, {"w": np.zeros(64, np.float32), "v": np.zeros(64, np.float32)}, max_shard_size=256
    )
    index = (tmp_path / INDEX).read_bytes()
    save_sharded(
        tmp_path, {"w": np.ones(64, np.float32), "v": np.ones(64, np.float32)}, max_shard_size=256
    )
    (tmp_path / INDEX).write_bytes(index)  # as if killed after the shards, before the index
    with pytest.raises(
        CheckpointFormatError, match="model-00001-of-00002.safetensors belongs to another save"
    ):
        load_sharded(tmp_path)


def test_replacing_another_tools_shards_never_mixes_two_saves(tmp_path, monkeypatch):
    """huggingface_hub's index carries no save token: before shards of the same names are
    replaced under it, it is removed, so a crash mid-save cannot leave old and new shards
    that load as one model."""
    from eqx_train.checkpoints.storage import _local

    old = {"a": np.zeros(64, np.float32), "b": np.zeros(64, np.float32)}
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        key = "a" if name.startswith("model-00001") else "b"
        safetensors.numpy.save_file({key: old[key]}, str(tmp_path / name), {"format": "pt"})
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (tmp_path / INDEX).write_text(
        json.dumps({"metadata": {"total_size": 512}, "weight_map": weight_map})
    )
    assert_trees_equal(load_sharded(tmp_path), old)
    real = _local.LocalStorage.atomic_write
    written = []

    def killed_after_one_shard(self, path, write, **kwargs):
        if written:
            raise KeyboardInterrupt("killed after the first shard")
        written.append(path)
        return real(self, path, write, **kwargs)

    monkeypatch.setattr(_local.LocalStorage, "atomic_write", killed_after_one_shard)
    new = {"a": np.ones(64, np.float32), "b": np.ones(64, np.float32)}
    with pytest.raises(KeyboardInterrupt):
        save_sharded(tmp_path, new, max_shard_size=256)
    monkeypatch.undo()
    assert written == [str(tmp_path / "model-00001-of-00002.safetensors")]
    with pytest.raises(FileNotFoundError, match="holds neither"):
        load_sharded(tmp_path)  # no index any more: refused, never new "a" with old "b"
    save_sharded(tmp_path, new, max_shard_size=256)  # the next save completes the switch
    assert_trees_equal(load_sharded(tmp_path), new)


def test_an_index_that_is_not_a_regular_file_is_refused_naming_it(tmp_path):
    (tmp_path / INDEX).mkdir()
    with pytest.raises(CheckpointFormatError, match=f"{INDEX}.*not a regular file"):
        load_sharded(tmp_path)
    (tmp_path / INDEX).rmdir()
    os.mkfifo(tmp_path / INDEX)
    with pytest.raises(CheckpointFormatError, match=f"{INDEX}.*not a regular file"):
        load_sharded(tmp_path)


def _write_index(directory, weight_map):
    (directory / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize(
    "file", ["../model.safetensors", "/etc/passwd", "sub/model.safetensors", "..", ""]
)
def test_hostile_index_file_names_are_refused(tmp_path, file):
    safetensors.numpy.save_file({"w": np.zeros(1)}, str(tmp_path / "a.safetensors"))
    _write_index(tmp_path, {"w": file})
    with pytest.raises(CheckpointFormatError, match="not a plain file name"):
        load_sharded(tmp_path)


def test_index_naming_a_tensor_its_file_lacks_is_refused_naming_the_file(tmp_path):
    safetensors.numpy.save_file({"w": np.zeros(1)}, str(tmp_path / "a.safetensors"))
    _write_index(tmp_path, {"w": "a.safetensors", "v": "a.safetensors"})
    with pytest.raises(CheckpointFormatError, match=r"'v' to a.safetensors, which lacks it"):
        load_sharded(tmp_path)


def test_a_missing_shard_is_refused_naming_it(tmp_path):
    safetensors.numpy.save_file({"w": np.zeros(1)}, str(tmp_path / "a.safetensors"))
    _write_index(tmp_path, {"w": "a.safetensors", "v": "b.safetensors"})
    with pytest.raises(CheckpointFormatError, match="b.safetensors, which is missing"):
        load_sharded(tmp_path)


def test_a_shard_holding_tensors_the_index_does_not_list_is_refused(tmp_path):
    safetensors.numpy.save_file(
        {"w": np.zeros(1), "x": np.ones(1)}, str(tmp_path / "a.safetensors")
    )
    _write_index(tmp_path, {"w": "a.safetensors"})
    with pytest.raises(CheckpointFormatError, match=r"a.safetensors holds tensors .*'x'"):
        load_sharded(tmp_path)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "[1]",
        '{"weight_map": [1]}',
        '{"weight_map": {"w": 3}}',
        '{"metadata": 1, "weight_map": {}}',
    ],
)
def test_malformed_index_is_refused_naming_it(tmp_path, text):
    (tmp_path / INDEX).write_text(text)
    with pytest.raises(CheckpointFormatError, match=INDEX.replace(".", r"\.")):
        load_sharded(tmp_path)


def test_a_corrupt_shard_fails_its_checksum_naming_the_file(tmp_path):
    save_sharded(
        tmp_path, {"w": np.zeros(64, np.float32), "v": np.zeros(64, np.float32)}, max_shard_size=256
    )
    path = tmp_path / "model-00002-of-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointFormatError, match="model-00002-of-00002.safetensors.*checksum"):
        load_sharded(tmp_path)


def test_only_the_shards_holding_needed_tensors_are_read(tmp_path, monkeypatch):
    save_sharded(
        tmp_path, {"w": np.zeros(64, np.float32), "v": np.ones(64, np.float32)}, max_shard_size=256
    )
    from eqx_train.checkpoints.format import _reader

    read_from = []
    real = _reader.FileReader._fill  # every read of a whole tensor from a local file

    def spy(self, info, out, verify):
        read_from.append(os.path.basename(self.path))
        return real(self, info, out, verify)

    monkeypatch.setattr(_reader.FileReader, "_fill", spy)
    with pytest.warns(PartialRestoreWarning, match="saved tensors went unused"):
        loaded = load_sharded(tmp_path, {"v": np.zeros(64, np.float32)}, strict=False)
    np.testing.assert_array_equal(loaded["v"], np.ones(64))
    assert read_from == [_index(tmp_path)["weight_map"]["v"]]


def test_a_directory_without_the_layout_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_sharded(tmp_path)
