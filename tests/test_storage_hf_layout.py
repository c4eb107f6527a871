"""The Hugging Face layouts read through `Storage`, so a model directory on an object store
restores as it does from a local directory: `model.safetensors`, or a sharded
`model.safetensors.index.json` with its pieces. Each test runs on `memory://` and on a
real S3 server (SeaweedFS on 127.0.0.1, started by the `s3_server` fixture)."""

import os
import pathlib

import fsspec
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_train.checkpoints import CheckpointFormatError, restore_checkpoint
from eqx_train.interop import save_sharded
from tests.support.helpers import assert_trees_equal

INDEX = "model.safetensors.index.json"


def _tree():
    return {
        "embed": {"weight": np.arange(64, dtype=np.float32).reshape(16, 4)},
        "layers": [
            {"weight": np.full((8, 8), 0.5, np.float32), "bias": jnp.ones(8, jnp.bfloat16)},
            {"weight": np.full((8, 8), -1.5, np.float32), "bias": jnp.zeros(8, jnp.bfloat16)},
        ],
    }


@pytest.fixture(params=["memory", "s3"])
def remote(request, tmp_path):
    """(URL of a fresh model directory, storage_options, an fsspec filesystem on it)."""
    if request.param == "memory":
        bucket = f"eqx-test-hf-{os.getpid()}-{id(tmp_path)}"
        fs = fsspec.filesystem("memory")
        yield f"memory://{bucket}/model", None, fs
        fs.rm(bucket, recursive=True)
    else:
        import s3fs

        server = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("s3_bucket")
        fs = s3fs.S3FileSystem(**server.storage_options)
        yield f"{bucket}/model", server.storage_options, fs


def _upload(fs, local: pathlib.Path, url: str) -> list[str]:
    names = sorted(os.listdir(local))
    for name in names:
        fs.pipe_file(f"{url}/{name}", (local / name).read_bytes())
    fs.invalidate_cache()
    return names


def test_a_model_safetensors_on_an_object_store_restores(remote, tmp_path):
    url, options, fs = remote
    save_sharded(tmp_path, _tree())
    assert _upload(fs, tmp_path, url) == ["model.safetensors"]
    assert_trees_equal(restore_checkpoint(url + "/", _tree(), storage_options=options), _tree())
    as_saved = restore_checkpoint(url + "/model.safetensors", None, storage_options=options)
    assert_trees_equal(as_saved, _tree())


def test_a_sharded_index_on_an_object_store_restores_from_its_pieces(remote, tmp_path):
    url, options, fs = remote
    save_sharded(tmp_path, _tree(), max_shard_size=300)
    names = _upload(fs, tmp_path, url)
    assert INDEX in names and len(names) > 2
    assert_trees_equal(restore_checkpoint(url + "/", _tree(), storage_options=options), _tree())
    from_index = restore_checkpoint(f"{url}/{INDEX}", _tree(), storage_options=options)
    assert_trees_equal(from_index, _tree())


def test_a_missing_piece_of_an_index_on_an_object_store_is_named(remote, tmp_path):
    url, options, fs = remote
    save_sharded(tmp_path, _tree(), max_shard_size=300)
    _upload(fs, tmp_path, url)
    fs.rm_file(f"{url}/model-00002-of-00003.safetensors")
    fs.invalidate_cache()
    with pytest.raises(CheckpointFormatError, match=r"model-00002-of-00003.*missing"):
        restore_checkpoint(url, _tree(), storage_options=options)
