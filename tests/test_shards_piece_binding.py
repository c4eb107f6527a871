"""Every piece file of a `.shards` checkpoint is bound to its save: a piece of another save
or step, copied under a name the index cites, is refused (naming it) before any of its
bytes are used, and `CheckpointManager.restore` falls back to the previous step."""

import os
import re
import shutil
from typing import Any

import numpy as np
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints import (
    CheckpointFormatError,
    CheckpointManager,
    UnreadableCheckpointWarning,
)
from tests.test_checkpoints_integrity import edit_header, reseal
from tests.test_checkpoints_multiprocess import FIXTURE, _run_job


def _values(value):
    """What tests/support/multiprocess_worker.py's `values(value)` saves (computed here alike)."""
    return {
        "a": np.arange(48, dtype=np.float32).reshape(8, 6) + value,
        "b": np.arange(4, dtype=np.int32) * value,
        "c": np.linspace(0, 1, 3) + value,
    }


@pytest.fixture(scope="module")
def saved_by_two(tmp_path_factory):
    """Two processes, 2 devices each, 'a' sharded by rows: steps 1 (values 100) and 2
    (values 200) of one run, and step 2 (values 300) of another run."""
    root = tmp_path_factory.mktemp("bind")
    _run_job("bind_save", 2, root / "run", root / "other_run")
    return root


@pytest.fixture
def run(saved_by_two, tmp_path):
    shutil.copytree(saved_by_two / "run", tmp_path / "run")
    return tmp_path / "run"


def _piece(shards_dir, process):
    [name] = [n for n in os.listdir(shards_dir) if n.startswith(f"process_{process:05d}.")]
    return shards_dir / name


def _restore_as_saved(path):
    return checkpoints.restore_checkpoint(path, None)


def test_a_two_process_save_restores_exactly_untouched(run):
    """The reference for the tests below: the untouched checkpoint is step 2's values."""
    restored = _restore_as_saved(run / "checkpoint_2.shards")
    for key, want in _values(200).items():
        np.testing.assert_array_equal(restored[key], want, strict=True)


def test_a_piece_of_an_earlier_step_under_the_cited_name_is_refused_naming_it(run):
    """The issue's case: process 1's piece of step 1 copied over step 2's process 1 piece
    (restored unchecked, 'a' mixed rows 0-3 of step 2 with rows 4-7 of step 1)."""
    target = _piece(run / "checkpoint_2.shards", 1)
    shutil.copyfile(_piece(run / "checkpoint_1.shards", 1), target)
    with pytest.raises(CheckpointFormatError, match="is not the piece it cites") as caught:
        _restore_as_saved(run / "checkpoint_2.shards")
    assert target.name in str(caught.value) and "checkpoint_2.shards" in str(caught.value)


def test_the_manager_falls_back_past_a_checkpoint_holding_another_saves_piece(run):
    shutil.copyfile(_piece(run / "checkpoint_1.shards", 1), _piece(run / "checkpoint_2.shards", 1))
    manager = CheckpointManager(run, keep_latest=2, handle_sigterm=False)
    with pytest.warns(UnreadableCheckpointWarning, match="checkpoint_2.shards"):
        restored: Any = manager.restore(None)  # the tree as saved
    for key, want in _values(100).items():
        np.testing.assert_array_equal(restored[key], want, strict=True)


def test_a_piece_of_the_same_step_of_another_run_is_refused(run, saved_by_two):
    target = _piece(run / "checkpoint_2.shards", 0)
    shutil.copyfile(_piece(saved_by_two / "other_run" / "checkpoint_2.shards", 0), target)
    with pytest.raises(CheckpointFormatError, match=re.escape(target.name)):
        _restore_as_saved(run / "checkpoint_2.shards")


def test_two_pieces_of_one_save_swapped_are_refused(run):
    first, second = _piece(run / "checkpoint_2.shards", 0), _piece(run / "checkpoint_2.shards", 1)
    data = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(data)
    with pytest.raises(CheckpointFormatError, match="is not the piece it cites") as caught:
        _restore_as_saved(run / "checkpoint_2.shards")
    assert re.search(r"process_0000[01]\.", str(caught.value))


def test_every_process_of_a_restore_refuses_a_piece_of_another_save(run):
    target = _piece(run / "checkpoint_2.shards", 1)
    shutil.copyfile(_piece(run / "checkpoint_1.shards", 1), target)
    outputs = _run_job("bind_restore", 2, run / "checkpoint_2.shards")
    for out in outputs:
        assert re.search(rf"^REFUSED \d .*{re.escape(target.name)}", out, re.M), out[-2000:]


def test_a_piece_copied_in_a_one_process_save_is_refused(tmp_path):
    for step in (1, 2):
        checkpoints.save_checkpoint_multiprocess(tmp_path, {"w": np.full(4, step)}, step, keep=2)
    target = _piece(tmp_path / "checkpoint_2.shards", 0)
    shutil.copyfile(_piece(tmp_path / "checkpoint_1.shards", 0), target)
    with pytest.raises(CheckpointFormatError, match=re.escape(target.name)):
        _restore_as_saved(tmp_path / "checkpoint_2.shards")


def test_a_checkpoint_written_before_pieces_were_bound_still_restores(tmp_path):
    """The fixture (two processes, an index and pieces without a save id) reads as saved."""
    shutil.copytree(FIXTURE, tmp_path / "old.shards")
    restored = _restore_as_saved(tmp_path / "old.shards")
    assert restored["n"] == 5
    np.testing.assert_array_equal(
        restored["rep"], np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + 5, strict=True
    )


def test_an_index_resealed_to_cite_another_saves_piece_by_its_own_name_is_refused(tmp_path):
    """The piece keeps its own name and the index is edited (checksums redone) to cite it."""
    for step in (1, 2):
        checkpoints.save_checkpoint_multiprocess(tmp_path, {"w": np.full(4, step)}, step, keep=2)
    stranger = _piece(tmp_path / "checkpoint_1.shards", 0)
    mine = _piece(tmp_path / "checkpoint_2.shards", 0)
    shutil.copyfile(stranger, mine.parent / stranger.name)

    def cite_stranger(header):
        meta = header["__metadata__"]
        meta["eqx_train.arrays"] = meta["eqx_train.arrays"].replace(mine.name, stranger.name)
        reseal(meta)

    edit_header(mine.parent / "index.safetensors", cite_stranger)
    with pytest.raises(CheckpointFormatError, match=re.escape(stranger.name)):
        _restore_as_saved(tmp_path / "checkpoint_2.shards")


def _unbind(shards_dir):
    """`shards_dir` as eqx_train wrote it before saves were bound to their pieces: no save
    id in its index, no save id or process in its pieces (as in `FIXTURE`)."""

    def drop_binding(header):
        for key in ("eqx_train.save", "eqx_train.process"):
            header["__metadata__"].pop(key, None)
        reseal(header["__metadata__"])

    for name in os.listdir(shards_dir):
        edit_header(shards_dir / name, drop_binding)


def test_a_bound_piece_under_a_name_an_index_of_before_binding_cites_is_refused(tmp_path):
    """Step 1 as an older eqx_train wrote it (its index without a save id), step 2 by this
    one: step 2's piece, copied over the piece step 1's index cites, is of another save."""
    for step in (1, 2):
        checkpoints.save_checkpoint_multiprocess(tmp_path, {"w": np.full(4, step)}, step, keep=2)
    _unbind(tmp_path / "checkpoint_1.shards")
    np.testing.assert_array_equal(_restore_as_saved(tmp_path / "checkpoint_1.shards")["w"], [1] * 4)
    target = _piece(tmp_path / "checkpoint_1.shards", 0)
    shutil.copyfile(_piece(tmp_path / "checkpoint_2.shards", 0), target)
    with pytest.raises(CheckpointFormatError, match=re.escape(target.name)):
        _restore_as_saved(tmp_path / "checkpoint_1.shards")


def test_an_index_without_a_save_id_citing_pieces_of_two_saves_is_refused(run):
    """No writer, of before binding or since, cites pieces of two saves in one index."""
    shards = run / "checkpoint_2.shards"
    mine, stranger = _piece(shards, 1), _piece(run / "checkpoint_1.shards", 1)
    shutil.copyfile(stranger, shards / stranger.name)
    mine.unlink()

    def cite_stranger_unbound(header):
        meta = header["__metadata__"]
        meta["eqx_train.arrays"] = meta["eqx_train.arrays"].replace(mine.name, stranger.name)
        del meta["eqx_train.save"]
        reseal(meta)

    edit_header(shards / "index.safetensors", cite_stranger_unbound)
    with pytest.raises(CheckpointFormatError, match="pieces of more than one save"):
        _restore_as_saved(shards)
