"""The local tier and its peer copies across real jax.distributed processes on loopback:
four processes, one CPU device each, an array sharded across them (no process holds
another's block), a local save every step and a persistent one every two."""

import json
import os
import shutil
import signal
import sys

import pytest

from tests.support.helpers import SUPPORT, flip_last_byte, free_port, run_processes, worker_env

WORKER = os.path.join(SUPPORT, "tiers_worker.py")
TIMEOUT_S = 240
COUNT = 4


def _run_job(mode, base, count=COUNT, killed=(), ended=()):
    """Runs the worker on `count` processes; each must print its OK line, except those in
    `killed`, which must die of SIGKILL, and those in `ended`, which must fail (any way).
    Returns each process's output."""
    port = str(free_port())
    env = worker_env()
    results = run_processes(
        [
            ([sys.executable, WORKER, mode, str(i), str(count), port, str(base)], env)
            for i in range(count)
        ],
        TIMEOUT_S,
    )
    for i, (returncode, out) in enumerate(results):
        if i in killed:
            assert returncode == -signal.SIGKILL, f"process {i} exited {returncode}:\n{out}"
            continue
        if i in ended:
            assert returncode != 0, f"process {i} survived:\n{out[-3000:]}"
            continue
        assert f"OK {mode} {i}" in out, f"process {i} exited {returncode}:\n{out[-3000:]}"
    return [out for _, out in results]


def _restored(outputs):
    """Each process's RESTORED report."""
    reports = []
    for out in outputs:
        lines = [line for line in out.splitlines() if line.startswith("RESTORED ")]
        assert len(lines) == 1, out[-3000:]
        reports.append(json.loads(lines[0].removeprefix("RESTORED ")))
    return reports


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A job that saved steps 0..5 to the local tiers and 0, 2, 4 to the persistent one."""
    base = tmp_path_factory.mktemp("tiers")
    _run_job("save", base)
    return base


def _copy(saved, tmp_path):
    base = tmp_path / "job"
    shutil.copytree(saved, base)
    return base


@pytest.mark.slow
def test_each_process_keeps_its_unit_and_its_peers_and_only_the_latest_local_step(saved):
    for i in range(COUNT):
        assert os.listdir(saved / f"local_{i}") == ["checkpoint_5.local"]
        units = sorted(os.listdir(saved / f"local_{i}" / "checkpoint_5.local"))
        peer = (i - 1) % COUNT
        assert units == sorted(
            [f"process_{i:05d}-of-00004.safetensors", f"process_{peer:05d}-of-00004.safetensors"]
        )
    assert sorted(os.listdir(saved / "persistent")) == ["checkpoint_4.shards"]


@pytest.mark.slow
def test_a_lost_local_directory_restores_the_newest_local_step_from_a_peer(saved, tmp_path):
    base = _copy(saved, tmp_path)
    shutil.rmtree(base / "local_1")  # a replaced host
    reports = _restored(_run_job("restore_local", base))  # reads of the persistent tier fail
    assert [r["step"] for r in reports] == [5] * COUNT
    assert [r["tier"] for r in reports] == ["local", "peer", "local", "local"]
    assert [r["host_state"] for r in reports] == [{"process": i, "step": 5} for i in range(4)]
    assert set(reports[1]["bytes_read"]) == {"peer"} and reports[1]["bytes_read"]["peer"] > 0


@pytest.mark.slow
def test_three_lost_local_directories_restore_the_newest_persistent_step(saved, tmp_path):
    base = _copy(saved, tmp_path)
    for i in (0, 1, 2):
        shutil.rmtree(base / f"local_{i}")
    reports = _restored(_run_job("restore_persistent", base))
    assert [r["step"] for r in reports] == [4] * COUNT
    assert [r["host_state"] for r in reports] == [{"process": i, "step": 4} for i in range(4)]


@pytest.mark.slow
def test_a_corrupt_local_copy_is_skipped_naming_it_and_its_peer_copy_restored(saved, tmp_path):
    base = _copy(saved, tmp_path)
    unit = base / "local_2" / "checkpoint_5.local" / "process_00002-of-00004.safetensors"
    flip_last_byte(unit)
    outputs = _run_job("restore_local", base)
    reports = _restored(outputs)
    assert [r["tier"] for r in reports] == ["local", "local", "peer", "local"]
    assert [r["step"] for r in reports] == [5] * COUNT
    assert str(unit) in outputs[2] and "UnreadableCheckpointWarning" in outputs[2]
    assert (unit.parent / f"corrupt-{unit.name}").exists()


@pytest.mark.slow
def test_a_corrupt_peer_copy_of_a_lost_unit_falls_back_to_the_persistent_tier(saved, tmp_path):
    base = _copy(saved, tmp_path)
    shutil.rmtree(base / "local_1")
    copy = base / "local_2" / "checkpoint_5.local" / "process_00001-of-00004.safetensors"
    flip_last_byte(copy)  # the only other copy of process 1's unit
    outputs = _run_job("restore_persistent", base)
    assert [r["step"] for r in _restored(outputs)] == [4] * COUNT
    assert str(copy) in outputs[2] and "UnreadableCheckpointWarning" in outputs[2]


@pytest.mark.slow
def test_an_async_managers_local_saves_restore_like_sync_ones(tmp_path):
    _run_job("save_async", tmp_path)
    shutil.rmtree(tmp_path / "local_3")
    reports = _restored(_run_job("restore_local", tmp_path))
    assert [(r["step"], r["tier"]) for r in reports] == [(5, "local")] * 3 + [(5, "peer")]


@pytest.mark.slow
def test_another_process_count_never_restores_from_the_local_copies(saved, tmp_path):
    base = _copy(saved, tmp_path)
    reports = _restored(_run_job("restore_persistent", base, count=2))
    assert [r["step"] for r in reports] == [4, 4]


@pytest.mark.slow
def test_a_kill_inside_a_local_write_never_restores_mixed_steps(tmp_path):
    outputs = _run_job("kill_mid_save", tmp_path, killed=(1,))
    assert "KILLED MID-WRITE" in outputs[1]
    # The kill landed mid-write: the unit's half-written temporary file is there, unrenamed.
    step_dir = tmp_path / "local_1" / "checkpoint_3.local"
    leftovers = [n for n in os.listdir(step_dir) if not n.startswith("process_00001-of")]
    own = [n for n in os.listdir(step_dir) if n.startswith("process_00001-of")]
    assert leftovers and not own, os.listdir(step_dir)
    reports = _restored(_run_job("restore_any", tmp_path))
    steps = {r["step"] for r in reports}
    # One step on every process (each checked bit-exact against that step by the worker).
    assert len(steps) == 1 and steps <= {2, 3}, reports


@pytest.mark.slow
def test_a_kill_inside_a_peer_transfer_restores_the_step_before_everywhere(tmp_path):
    outputs = _run_job("kill_mid_transfer", tmp_path, killed=(1,), ended=(0, 2, 3))
    assert "KILLED MID-TRANSFER" in outputs[1]
    # Process 1's unit of step 3 exists nowhere (some survivors may hold others' step 3
    # units, never a complete step 3), and step 2 stayed everywhere: older steps go only
    # once every process has written the new one.
    for i in range(COUNT):
        assert "checkpoint_2.local" in os.listdir(tmp_path / f"local_{i}"), i
        step_3 = tmp_path / f"local_{i}" / "checkpoint_3.local"
        assert not (step_3 / "process_00001-of-00004.safetensors").exists()
    reports = _restored(_run_job("restore_any", tmp_path))
    assert [(r["step"], r["tier"]) for r in reports] == [(2, "local")] * COUNT
