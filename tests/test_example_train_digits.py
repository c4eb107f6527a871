"""examples/train_digits.py end to end: accuracy line, curves, checkpoints, exact resume."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from eqx_train import checkpoints

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
    "--no-progress",
    "--keep",
    "2",
    "--keep-every",
    "2",
]


def _run(workdir, *extra):
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
    }
    result = subprocess.run(
        [sys.executable, EXAMPLE, "--workdir", str(workdir), *FAST, *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _final_arrays(workdir):
    restored = checkpoints.restore_checkpoint(os.path.join(workdir, "checkpoints"), None)
    return restored["state"], restored["epoch"]


@pytest.mark.slow
def test_example_trains_plots_checkpoints_and_resumes_exactly(tmp_path):
    straight = tmp_path / "straight"
    out = _run(straight)
    match = re.search(r"^test accuracy: (0\.\d{3}|1\.000)$", out, flags=re.M)
    assert match, out
    assert float(match.group(1)) > 0.8  # 3 short epochs; the full run reaches >= 0.95
    with open(straight / "curves.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # keep=2 newest (1, 2) plus keep_every_n_steps=2 picks among older ones (0 is never kept
    # by that rule, as in flax).
    assert checkpoints.available_steps(straight / "checkpoints") == [1, 2]

    resumed = tmp_path / "resumed"
    first = _run(resumed, "--stop-after", "1")
    assert "stopping after 1 epoch(s)" in first and "test accuracy" not in first
    second = _run(resumed)
    assert "resuming from" in second and "at epoch 1" in second
    assert re.search(r"^test accuracy: ", second, flags=re.M)

    state_a, epoch_a = _final_arrays(straight)
    state_b, epoch_b = _final_arrays(resumed)
    assert epoch_a == epoch_b == 2
    for name in state_a["model"]["layers"][0]:
        np.testing.assert_array_equal(
            state_a["model"]["layers"][0][name], state_b["model"]["layers"][0][name]
        )
    flat_a = {k: v for k, v in _flatten(state_a)}
    flat_b = {k: v for k, v in _flatten(state_b)}
    assert flat_a.keys() == flat_b.keys()
    for key in flat_a:
        np.testing.assert_array_equal(flat_a[key], flat_b[key], err_msg=key)


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}{k}.")
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from _flatten(v, f"{prefix}{i}.")
    elif tree is not None:
        yield prefix.rstrip("."), np.asarray(tree)


def test_help_explains_every_flag():
    result = subprocess.run(
        [sys.executable, EXAMPLE, "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0
    for flag in (
        "--workdir",
        "--epochs",
        "--batch-size",
        "--learning-rate",
        "--warmup-epochs",
        "--hidden",
        "--dropout",
        "--patience",
        "--min-delta",
        "--eval-batch-size",
        "--keep",
        "--keep-every",
        "--seed",
        "--stop-after",
        "--no-progress",
    ):
        assert flag in result.stdout
