"""Exact resume (docs/resuming_exactly.md): a run killed with SIGKILL in the middle of a save
and started again ends with every array bit for bit equal to a run that was never stopped,
in the mesh track (`jit_step`) and the pmap track (`pmap_step`).

The kill lands at a known point: the worker (tests/support/resume_worker.py) stops inside the write
of the checkpoint after step 8 (its temporary file written, not yet renamed), prints
`in-save 8` and waits; the test checks the temporary file is there and the newest
checkpoint is step 6 (half of the 12 steps), then SIGKILLs it. The resumed run must start
at step 6 and redo steps 7 and 8 exactly as the uninterrupted run did.
"""

import os
import signal
import subprocess
import sys

import pytest

from eqx_train import checkpoints
from tests.support.helpers import assert_trees_equal, xla_flags

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, KILL_AT, LAST_GOOD = 12, 8, 6


def _worker(*args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags()}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.resume_worker", *map(str, args)],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process):
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    return out.split("\n")


def _kill_in_save(workdir, track, out):
    process = _worker(workdir, track, out, KILL_AT)
    assert process.stdout is not None and process.stderr is not None  # pipes
    try:
        lines = []
        for line in process.stdout:
            lines.append(line.strip())
            if line.startswith("in-save"):
                break
        assert lines[-1:] == [f"in-save {KILL_AT}"], (lines, process.stderr.read()[-3000:])
        # Proof that the kill lands mid-save: the new checkpoint's bytes are in a temporary
        # file, and the newest checkpoint is still the one before it.
        names = os.listdir(workdir)
        assert any(".tmp" in name for name in names), names
        assert checkpoints.available_steps(workdir) == [LAST_GOOD - 2, LAST_GOOD]
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
        assert process.returncode == -signal.SIGKILL
        return lines
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for stream in (process.stdin, process.stdout, process.stderr):
            if stream is not None:
                stream.close()


@pytest.mark.parametrize("track", ["mesh", "pmap"])
def test_killed_mid_save_and_resumed_equals_uninterrupted_bit_for_bit(tmp_path, track):
    straight_out, resumed_out = tmp_path / "straight_final", tmp_path / "resumed_final"
    straight = _worker(tmp_path / "straight", track, straight_out)
    # The uninterrupted run and the run to be killed go side by side.
    killed_lines = _kill_in_save(tmp_path / "run", track, resumed_out)
    assert killed_lines[0] == "start 0" and "saved 6" in killed_lines
    assert _finish(straight)[0] == "start 0"

    resumed_lines = _finish(_worker(tmp_path / "run", track, resumed_out))
    assert resumed_lines[0] == f"start {LAST_GOOD}"
    assert [line for line in resumed_lines if line.startswith("saved")] == [
        f"saved {step}" for step in range(LAST_GOOD + 2, STEPS + 1, 2)
    ]
    expected = checkpoints.restore_checkpoint(straight_out, None)
    got = checkpoints.restore_checkpoint(resumed_out, None)
    assert int(got["position"]) == STEPS and int(got["state"]["step"]) == STEPS
    assert (got["losses"] != 0).all()  # every step's loss was recorded, before and after
    assert_trees_equal(got, expected)
