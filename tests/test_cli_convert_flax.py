"""`eqx-train convert-flax`: flax msgpack checkpoints written by flax itself, converted to
eqx_train checkpoints with their steps. Needs `eqx_train.interop.load_flax_checkpoint`."""

import os

import numpy as np
import pytest

flax_checkpoints = pytest.importorskip("flax.training.checkpoints")

from eqx_train._cli import main  # noqa: E402
from eqx_train.checkpoints import (  # noqa: E402
    available_steps,
    restore_checkpoint,
    save_checkpoint,
)
from tests.support.helpers import assert_trees_equal  # noqa: E402

# flax announces its msgpack checkpoints' deprecation on every save; these tests need them.
pytestmark = pytest.mark.filterwarnings("ignore:Flax Checkpointing will soon be deprecated")


def _flax_tree(scale):
    return {
        "params": {"dense": {"kernel": np.full((2, 3), scale, np.float32)}},
        "count": np.int32(7),
    }


def _save_flax(directory, step, scale):
    # flax's legacy msgpack path (no Orbax): what existing flax.training users have on disk.
    before = flax_checkpoints.config.flax_use_orbax_checkpointing
    flax_checkpoints.config.update("flax_use_orbax_checkpointing", False)
    try:
        return flax_checkpoints.save_checkpoint(
            str(directory), _flax_tree(scale), step, keep=10, overwrite=True
        )
    finally:
        flax_checkpoints.config.update("flax_use_orbax_checkpointing", before)


def test_convert_flax_directory_keeps_every_step(tmp_path, capsys):
    for step, scale in ((1, 1.0), (5, 2.0), (20, 3.0)):
        _save_flax(tmp_path / "flax", step, scale)
    assert main(["convert-flax", str(tmp_path / "flax"), str(tmp_path / "eqx")]) == 0
    assert available_steps(tmp_path / "eqx") == [1, 5, 20]
    for step, scale in ((1, 1.0), (5, 2.0), (20, 3.0)):
        restored = restore_checkpoint(tmp_path / "eqx", None, step=step)
        expected = flax_checkpoints.restore_checkpoint(str(tmp_path / "flax"), None, step=step)
        assert_trees_equal(restored, expected)
        assert restored["params"]["dense"]["kernel"][0, 0] == scale


def test_convert_flax_single_file_takes_its_step_from_the_name(tmp_path):
    path = _save_flax(tmp_path / "flax", 42, 1.5)
    assert main(["convert-flax", path, str(tmp_path / "eqx")]) == 0
    assert available_steps(tmp_path / "eqx") == [42]


def test_convert_flax_never_deletes_what_the_destination_holds(tmp_path):
    eqx_dir = tmp_path / "eqx"
    save_checkpoint(eqx_dir, {"x": np.zeros(2)}, 0)
    for step in (1, 2):
        _save_flax(tmp_path / "flax", step, float(step))
    assert main(["convert-flax", str(tmp_path / "flax"), str(eqx_dir)]) == 0
    assert available_steps(eqx_dir) == [0, 1, 2]


def test_convert_flax_refuses_two_files_of_one_step_before_writing(tmp_path, capsys):
    path = _save_flax(tmp_path / "flax", 1, 1.0)
    os.link(path, tmp_path / "flax" / "checkpoint_01")
    assert main(["convert-flax", str(tmp_path / "flax"), str(tmp_path / "eqx")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "both step 1" in err[0]
    assert not os.path.exists(tmp_path / "eqx")


def test_convert_flax_of_a_missing_path_is_one_line_exit_1(tmp_path, capsys):
    assert main(["convert-flax", str(tmp_path / "nope"), str(tmp_path / "eqx")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope" in err[0]
    assert not os.path.exists(tmp_path / "eqx")


def test_convert_flax_of_a_file_named_without_a_step_refuses_to_guess_one(tmp_path, capsys):
    saved = _save_flax(tmp_path / "flax", 42, 1.5)
    renamed = tmp_path / "model.msgpack"
    os.rename(saved, renamed)
    assert main(["convert-flax", str(renamed), str(tmp_path / "eqx")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("with --step N\n") and "checkpoint_<step>" in err
    assert not os.path.exists(tmp_path / "eqx")
    assert main(["convert-flax", str(renamed), str(tmp_path / "eqx"), "--step", "42"]) == 0
    assert available_steps(tmp_path / "eqx") == [42]


def test_convert_flax_step_names_one_file_not_a_directory(tmp_path, capsys):
    _save_flax(tmp_path / "flax", 1, 1.0)
    argv = ["convert-flax", str(tmp_path / "flax"), str(tmp_path / "eqx"), "--step", "3"]
    assert main(argv) == 1
    assert "each converted as its own step" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "eqx")


def test_convert_flax_into_a_destination_holding_a_newer_step_refuses_before_writing(
    tmp_path, capsys
):
    eqx_dir = tmp_path / "eqx"
    save_checkpoint(eqx_dir, {"x": np.zeros(2)}, 9)
    for step in (1, 20):
        _save_flax(tmp_path / "flax", step, float(step))
    assert main(["convert-flax", str(tmp_path / "flax"), str(eqx_dir)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds step 9; the steps to convert (1, 20)" in err
    assert "overwrite=" not in err  # the command line has no such option
    assert available_steps(eqx_dir) == [9]
