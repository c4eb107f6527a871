"""examples/train_digits.py end to end, in both parallel modes: accuracy line, curves,
checkpoints, exact resume, and checkpoints that move between the modes."""

import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from eqx_train import checkpoints
from tests.support.helpers import xla_flags

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "train_digits.py")
FAST = [
    "--epochs",
    "3",
    "--hidden",
    "64",
    "--warmup-epochs",
    "0.5",
    "--learning-rate",
    "1e-2",
    "--batch-size",
    "32",
    "--no-progress",
    "--keep",
    "2",
    "--keep-every",
    "2",
]


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory):
    """A compilation cache the module's runs of the example share: they compile the same
    programs, and a run is never killed, so no entry is left half written."""
    return tmp_path_factory.mktemp("xla-cache")


def _run(workdir, *extra, cache):
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags(8),
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    result = subprocess.run(
        [sys.executable, "-W", "error", EXAMPLE, "--workdir", str(workdir), *FAST, *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _test_accuracy(out):
    match = re.search(r"^test accuracy: (0\.\d{3}|1\.000)$", out, flags=re.M)
    assert match, out
    return float(match.group(1))


def _final_state(workdir):
    restored = checkpoints.restore_checkpoint(os.path.join(workdir, "checkpoints"), None)
    return restored["state"], restored["epoch"]


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}{k}.")
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from _flatten(v, f"{prefix}{i}.")
    elif tree is not None:
        yield prefix.rstrip("."), np.asarray(tree)


@pytest.fixture(scope="module")
def mesh_stopped_after_one_epoch(tmp_path_factory, xla_cache):
    """A workdir where the mesh mode trained epoch 0 and stopped (`--stop-after 1`), and
    what it printed: a start both the resume test and the mode-switch test continue from
    (each on its own copy), run once."""
    workdir = tmp_path_factory.mktemp("mesh-stopped") / "work"
    return workdir, _run(workdir, "--parallel", "mesh", "--stop-after", "1", cache=xla_cache)


def _copy_of(stopped, tmp_path):
    workdir, out = stopped
    shutil.copytree(workdir, tmp_path / "work")
    return tmp_path / "work", out


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["mesh", "pmap"])
def test_example_trains_plots_checkpoints_and_resumes_exactly(
    tmp_path, parallel, mesh_stopped_after_one_epoch, xla_cache
):
    mode = ["--parallel", parallel]
    straight = tmp_path / "straight"
    out = _run(straight, *mode, cache=xla_cache)
    assert f"parallel: {parallel} over 8 cpu devices" in out
    # 3 short epochs (0.917 in both modes when written); the full run reaches >= 0.95.
    assert _test_accuracy(out) > 0.8
    with open(straight / "curves.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # keep=2 newest (1, 2) plus keep_every_n_steps=2 picks among older ones (0 is never kept
    # by that rule, as in flax).
    assert checkpoints.available_steps(straight / "checkpoints") == [1, 2]

    if parallel == "mesh":
        resumed, first = _copy_of(mesh_stopped_after_one_epoch, tmp_path)
    else:
        resumed = tmp_path / "resumed"
        first = _run(resumed, *mode, "--stop-after", "1", cache=xla_cache)
    assert "stopping after 1 epoch(s)" in first and "test accuracy" not in first
    second = _run(resumed, *mode, cache=xla_cache)
    assert "resuming from" in second and "at epoch 1" in second
    _test_accuracy(second)

    state_a, epoch_a = _final_state(straight)
    state_b, epoch_b = _final_state(resumed)
    assert epoch_a == epoch_b == 2
    flat_a = dict(_flatten(state_a))
    flat_b = dict(_flatten(state_b))
    assert flat_a.keys() == flat_b.keys()
    assert any(key.startswith("model.layers.0") for key in flat_a)
    for key in flat_a:
        np.testing.assert_array_equal(flat_a[key], flat_b[key], err_msg=key)


@pytest.mark.slow
def test_checkpoints_move_between_mesh_and_pmap_modes(
    tmp_path, mesh_stopped_after_one_epoch, xla_cache
):
    # mesh writes epoch 0; pmap resumes from it and trains epochs 1-2; mesh then resumes
    # from pmap's final checkpoint (nothing left to train) and must score the same weights
    # exactly as pmap did.
    workdir, first = _copy_of(mesh_stopped_after_one_epoch, tmp_path)
    assert "stopping after 1 epoch(s)" in first
    saved_epoch_0 = dict(_flatten(_final_state(workdir)[0]))
    shutil.copytree(workdir / "checkpoints", tmp_path / "epoch0")

    by_pmap = _run(workdir, "--parallel", "pmap", cache=xla_cache)
    assert "resuming from" in by_pmap and "at epoch 1" in by_pmap
    pmap_accuracy = _test_accuracy(by_pmap)
    assert pmap_accuracy > 0.8
    trained = dict(_flatten(_final_state(workdir)[0]))
    assert trained.keys() == saved_epoch_0.keys()
    assert not np.array_equal(
        trained["model.layers.0.weight"], saved_epoch_0["model.layers.0.weight"]
    )

    by_mesh = _run(workdir, "--parallel", "mesh", cache=xla_cache)
    assert "resuming from" in by_mesh and "at epoch 3" in by_mesh
    assert _test_accuracy(by_mesh) == pmap_accuracy


@functools.cache
def _load_example():
    spec = importlib.util.spec_from_file_location("train_digits_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations there
    spec.loader.exec_module(module)
    return module


def test_help_describes_every_option_the_parser_accepts():
    parser = _load_example().build_parser()
    help_text = parser.format_help()
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 16
    for action in options:
        assert action.help and len(action.help) > 10, f"{action.option_strings} has no help"
        for flag in action.option_strings:
            # The whole flag, not a prefix of a longer one (--keep vs --keep-every).
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text), flag


def test_parallel_defaults_to_mesh_and_accepts_only_mesh_or_pmap(capsys):
    example = _load_example()
    assert example.parse_args([]).parallel == "mesh"
    assert example.parse_args(["--parallel", "pmap"]).parallel == "pmap"
    with pytest.raises(SystemExit):
        example.parse_args(["--parallel", "tpu"])
    assert "invalid choice: 'tpu'" in capsys.readouterr().err
