"""SIGKILL at any moment leaves the latest complete checkpoint restorable."""

import os
import textwrap

import numpy as np
import pytest

from eqx_train import checkpoints
from tests.helpers import run_then_sigkill

WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from eqx_train import checkpoints

    ckpt_dir = sys.argv[1]
    for step in range(1, 10_000):
        tree = {"step": np.asarray(step), "w": np.full((4, 1 << 20), step, np.float32)}
        checkpoints.save_checkpoint(ckpt_dir, tree, step, keep=2)
        print(step, flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.013, 0.037, 0.071])
def test_sigkill_mid_save_leaves_latest_complete_checkpoint(tmp_path, delay):
    run_then_sigkill(WRITER, str(tmp_path), after_line=3, delay=delay)
    steps = checkpoints.available_steps(tmp_path)
    assert steps, "no checkpoint survived"
    for step in steps:  # every file under a final name is complete and correct
        restored = checkpoints.restore_checkpoint(tmp_path, None, step=step)
        assert int(restored["step"]) == step
        assert restored["w"].shape == (4, 1 << 20)
        assert np.all(restored["w"] == step)
    visible = [n for n in os.listdir(tmp_path) if not n.startswith(".")]
    assert sorted(visible) == sorted(f"checkpoint_{s}.safetensors" for s in steps)
