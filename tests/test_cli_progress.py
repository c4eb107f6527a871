"""The command line's progress bars: `convert-*`, `verify` and `inspect` of a directory draw
one on stderr with `--progress` (by default: when stderr is a terminal), never on stdout,
and only once the work has taken about a second."""

import numpy as np
import pytest

from eqx_train import _progress
from eqx_train._cli import main
from eqx_train.checkpoints import save_checkpoint

pytest.importorskip("tqdm")
flax_checkpoints = pytest.importorskip("flax.training.checkpoints")
pytestmark = pytest.mark.filterwarnings("ignore:Flax Checkpointing will soon be deprecated")

TREE = {"w": np.arange(4096, dtype=np.float32), "b": np.ones(16, np.float64)}


@pytest.fixture
def at_once(monkeypatch):
    """Bars drawn at once, as a transfer longer than a second draws them."""
    monkeypatch.setattr(_progress, "BAR_DELAY_S", 0.0)


def _saved(directory, steps=(1,)):
    for step in steps:
        save_checkpoint(directory, TREE, step, keep=10)
    return directory


def test_verify_with_progress_draws_its_bar_on_stderr(tmp_path, capsys, at_once):
    _saved(tmp_path)
    assert main(["verify", str(tmp_path / "checkpoint_1.safetensors"), "--progress"]) == 0
    out, err = capsys.readouterr()
    assert out.strip().endswith(": ok")
    assert "verify checkpoint_1.safetensors" in err and "B/s" in err, err


def test_inspect_of_a_directory_with_progress_counts_the_headers_read(tmp_path, capsys, at_once):
    _saved(tmp_path, steps=(1, 2, 3))
    assert main(["inspect", str(tmp_path), "--progress"]) == 0
    out, err = capsys.readouterr()
    assert "directory of 3 checkpoints" in out and "ckpt" not in out
    assert "headers" in err and "/3 " in err and "ckpt/s" in err, err


def test_convert_flax_with_progress_draws_a_bar_per_checkpoint(tmp_path, capsys, at_once):
    before = flax_checkpoints.config.flax_use_orbax_checkpointing
    flax_checkpoints.config.update("flax_use_orbax_checkpointing", False)
    try:
        flax_checkpoints.save_checkpoint(str(tmp_path / "flax"), TREE, 7, keep=10)
    finally:
        flax_checkpoints.config.update("flax_use_orbax_checkpointing", before)
    assert main(["convert-flax", str(tmp_path / "flax"), str(tmp_path / "eqx"), "--progress"]) == 0
    out, err = capsys.readouterr()
    assert "checkpoint_7" in out
    assert "checkpoint_7" in err and "B/s" in err, err


@pytest.mark.parametrize("flag", [[], ["--no-progress"]])
def test_without_a_terminal_or_with_no_progress_nothing_is_drawn(tmp_path, capsys, at_once, flag):
    _saved(tmp_path, steps=(1, 2))
    assert main(["verify", str(tmp_path), *flag]) == 0
    assert main(["inspect", str(tmp_path), *flag]) == 0
    assert capsys.readouterr().err == ""  # pytest's stderr is not a terminal


def test_a_short_command_draws_no_bar_even_with_progress(tmp_path, capsys):
    _saved(tmp_path)
    assert main(["verify", str(tmp_path), "--progress"]) == 0
    assert capsys.readouterr().err == ""
