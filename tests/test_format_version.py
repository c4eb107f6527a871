"""A header's format version (and every number a reader takes from a file or an index's
names) is ASCII digits: any other spelling is a corrupt file, named, which a manager skips
for the previous step; only ASCII digits above this version mean a newer eqx_train."""

import json
import os
import pathlib
import struct

import numpy as np
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints import (
    CheckpointFormatError,
    CheckpointManager,
    NewerFormatError,
    UnreadableCheckpointWarning,
)
from eqx_train.checkpoints.format._checksums import text_digest

VERSION = "eqx_train.format_version"


def _edit_header(path, edit):
    """Rewrites the safetensors header of `path` through `edit(header)` (offsets are
    relative to the data, so the header may change length)."""
    raw = pathlib.Path(path).read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + length])
    edit(header)
    text = json.dumps(header).encode()
    pathlib.Path(path).write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])


def _set_version(version):
    def edit(header):
        header["__metadata__"][VERSION] = version

    return edit


NOT_VERSIONS = ["²", "١", "٢", "１", " 1", "1 ", "+1", "1_0", "2_0", "-1", "1.0", "", "0x2"]


@pytest.mark.parametrize("version", NOT_VERSIONS)
def test_a_version_not_spelled_in_ascii_digits_is_a_corrupt_file_named(tmp_path, version):
    path = checkpoints.save_checkpoint(tmp_path, {"a": np.arange(3.0)}, 1)
    _edit_header(path, _set_version(version))
    with pytest.raises(CheckpointFormatError, match="format version") as caught:
        checkpoints.restore_checkpoint(path, None)
    assert type(caught.value) is CheckpointFormatError
    assert str(path) in str(caught.value)


def test_a_higher_version_in_ascii_digits_is_a_newer_format(tmp_path):
    path = checkpoints.save_checkpoint(tmp_path, {"a": np.arange(3.0)}, 1)
    _edit_header(path, _set_version("12"))
    with pytest.raises(NewerFormatError, match="12"):
        checkpoints.restore_checkpoint(path, None)


def test_the_manager_falls_back_past_a_version_of_other_digits(tmp_path):
    manager = CheckpointManager(tmp_path, keep_latest=2, handle_sigterm=False)
    manager.save(1, {"a": np.arange(3.0)})
    newest = manager.save(2, {"a": np.arange(3.0) + 1})
    manager.wait()
    _edit_header(newest, _set_version("²"))
    with pytest.raises(CheckpointFormatError, match=r"checkpoint_2\.safetensors"):
        checkpoints.restore_checkpoint(newest, None)  # not a bare ValueError
    with pytest.warns(UnreadableCheckpointWarning, match="checkpoint_2"):
        restored = manager.restore({"a": np.zeros(3)})
    np.testing.assert_array_equal(restored["a"], np.arange(3.0), strict=True)


def test_a_shards_index_version_of_other_digits_is_a_corrupt_index_named(tmp_path):
    shards = checkpoints.save_checkpoint_multiprocess(tmp_path, {"a": np.arange(3.0)}, 1)
    index = os.path.join(shards, "index.safetensors")
    _edit_header(index, _set_version("٢"))
    with pytest.raises(CheckpointFormatError, match="format version") as caught:
        checkpoints.restore_checkpoint(shards, None)
    assert type(caught.value) is CheckpointFormatError and index in str(caught.value)


def test_an_index_citing_a_piece_name_of_other_digits_is_refused(tmp_path):
    """`process_٠٠٠٠٠.…` is no name of this library's, though `int()` reads its digits."""
    shards = checkpoints.save_checkpoint_multiprocess(tmp_path, {"a": np.arange(3.0)}, 1)
    [piece] = [n for n in os.listdir(shards) if n.startswith("process_")]
    other = piece.replace("00000", "٠٠٠٠٠")
    os.rename(os.path.join(shards, piece), os.path.join(shards, other))

    def edit(header):  # resealed, as anyone can: the checksums guard against accidents
        metadata = header["__metadata__"]
        metadata["eqx_train.arrays"] = metadata["eqx_train.arrays"].replace(piece, other)
        sealed = json.loads(metadata["eqx_train.checksums"])
        sealed["metadata"]["eqx_train.arrays"] = text_digest(metadata["eqx_train.arrays"])
        metadata["eqx_train.checksums"] = json.dumps(sealed)

    _edit_header(os.path.join(shards, "index.safetensors"), edit)
    with pytest.raises(CheckpointFormatError, match="not a piece file name"):
        checkpoints.restore_checkpoint(shards, None)


@pytest.mark.parametrize("digits", [400, 5000])
def test_a_version_of_hundreds_or_thousands_of_ascii_digits_is_a_newer_format_named(
    tmp_path, digits
):
    """Python's `int()` refuses more than 4300 digits with a bare ValueError."""
    path = checkpoints.save_checkpoint(tmp_path, {"a": np.arange(3.0)}, 1)
    _edit_header(path, _set_version("9" * digits))
    with pytest.raises(NewerFormatError) as caught:
        checkpoints.restore_checkpoint(path, None)
    assert str(path) in str(caught.value)


def test_a_version_of_leading_zeros_and_thousands_of_digits_is_a_corrupt_file_named(tmp_path):
    """ "0…02" is version 2 in no writer's spelling; no `int()` of it is attempted."""
    path = checkpoints.save_checkpoint(tmp_path, {"a": np.arange(3.0)}, 1)
    _edit_header(path, _set_version("0" * 5000 + "2"))
    with pytest.raises(CheckpointFormatError, match="format version") as caught:
        checkpoints.restore_checkpoint(path, None)
    assert type(caught.value) is CheckpointFormatError and str(path) in str(caught.value)
