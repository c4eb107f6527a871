"""A checkpoint that a newer eqx_train wrote (or that looks so, by one flipped bit) is refused
by name and never moved aside or deleted, by restores and by retention alike."""

import os
import pathlib

import numpy as np
import pytest

from eqx_train.checkpoints import (
    CheckpointManager,
    NewerFormatError,
)


def _bump_format_version(path):
    """The file as a newer eqx_train (format version 9) would write it: same length."""
    raw = bytearray(pathlib.Path(path).read_bytes())
    at = raw.index(b'"eqx_train.format_version":"1"')
    raw[at : at + 30] = b'"eqx_train.format_version":"9"'
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
    # '1' (0x31) with one bit flipped reads '9': it looks newer, so nothing may move it; the
    # error names the file and says what to do if no newer eqx_train wrote it.
    manager = CheckpointManager(tmp_path, keep_latest=5)
    manager.save(1, {"a": np.arange(3.0)})
    newest = manager.save(2, {"a": np.arange(3.0)})
    manager.wait()
    raw = bytearray(pathlib.Path(newest).read_bytes())
    at = raw.index(b'"eqx_train.format_version":"1"') + len(b'"eqx_train.format_version":"')
    raw[at] ^= 0x08
    pathlib.Path(newest).write_bytes(raw)
    with pytest.raises(NewerFormatError, match=r"checkpoint_2\.safetensors .*move it away by hand"):
        manager.restore({"a": np.zeros(3)})
    assert pathlib.Path(newest).read_bytes() == bytes(raw)
