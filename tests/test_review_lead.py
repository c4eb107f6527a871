"""Defects found in review of the model-changes work (issue 27), fixed outside the matcher."""

import os
import pathlib

import numpy as np
import pytest

from eqx_train.checkpoints import (
    CheckpointManager,
    NewerFormatError,
    restore_checkpoint,
    save_checkpoint,
)


def test_tied_numpy_leaves_restored_from_one_tensor_do_not_alias(tmp_path):
    save_checkpoint(tmp_path, {"emb": np.arange(3.0)}, 1)
    target = {"emb": np.zeros(3), "out": np.zeros(3)}
    restored = restore_checkpoint(tmp_path, target, rename={"out": "emb"})
    np.testing.assert_array_equal(restored["out"], np.arange(3.0))
    restored["out"] += 1
    np.testing.assert_array_equal(restored["emb"], np.arange(3.0))


@pytest.mark.parametrize(
    "option",
    [{"rename": {"b": "a"}}, {"casting": "unsafe"}, {"filter_spec": lambda x: False}],
    ids=["rename", "casting", "filter_spec"],
)
def test_target_options_with_target_none_are_refused_not_ignored(tmp_path, option):
    save_checkpoint(tmp_path, {"a": np.arange(3.0)}, 1)
    (name,) = option
    with pytest.raises(ValueError, match=rf"restore_checkpoint: {name} applies to a target"):
        restore_checkpoint(tmp_path, None, **option)


def _bump_format_version(path):
    """The file as a newer eqx_train (format version 3) would write it: same length."""
    raw = bytearray(pathlib.Path(path).read_bytes())
    at = raw.index(b'"eqx_train.format_version":"1"')
    raw[at : at + 30] = b'"eqx_train.format_version":"3"'
    pathlib.Path(path).write_bytes(raw)


def test_a_newer_eqx_trains_checkpoint_is_refused_by_name_never_moved_aside(tmp_path):
    manager = CheckpointManager(tmp_path, keep_latest=5)
    manager.save(1, {"a": np.arange(3.0)})
    newest = manager.save(2, {"a": np.arange(3.0) + 1})
    manager.wait()
    _bump_format_version(newest)
    with pytest.raises(NewerFormatError, match="newer eqx_train.*Upgrade eqx_train"):
        manager.restore({"a": np.zeros(3)})
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_1.safetensors", "checkpoint_2.safetensors"]


def test_retention_never_deletes_a_newer_eqx_trains_best_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path, keep_latest=1, keep_best=1, best_metric="loss")
    best = manager.save(1, {"a": np.arange(3.0)}, metrics={"loss": 0.1})
    manager.wait()
    _bump_format_version(best)
    with pytest.raises(NewerFormatError):
        manager.save(2, {"a": np.arange(3.0)}, metrics={"loss": 0.5})
        manager.wait()
    assert "checkpoint_1.safetensors" in os.listdir(tmp_path)


def test_a_version_digit_flipped_by_one_bit_is_refused_naming_the_file_and_kept(tmp_path):
    # '1' (0x31) with one bit flipped reads '3': it looks newer, so nothing may move it; the
    # error names the file and says what to do if no newer eqx_train wrote it.
    manager = CheckpointManager(tmp_path, keep_latest=5)
    manager.save(1, {"a": np.arange(3.0)})
    newest = manager.save(2, {"a": np.arange(3.0)})
    manager.wait()
    raw = bytearray(pathlib.Path(newest).read_bytes())
    at = raw.index(b'"eqx_train.format_version":"1"') + len(b'"eqx_train.format_version":"')
    raw[at] ^= 0x02
    pathlib.Path(newest).write_bytes(raw)
    with pytest.raises(NewerFormatError, match=r"checkpoint_2\.safetensors .*move it away by hand"):
        manager.restore({"a": np.zeros(3)})
    assert pathlib.Path(newest).read_bytes() == bytes(raw)
