"""Multi-process checkpoints with real jax.distributed processes on loopback."""

import os
import re
import sys

import pytest

from tests.helpers import free_port, run_processes

WORKER = os.path.join(os.path.dirname(__file__), "multiprocess_worker.py")
TIMEOUT_S = 90


def _run_job(mode, count, *dirs, expected_exit=None, extra_env=None):
    """Runs `count` worker processes; each must print its OK line, except the processes in
    `expected_exit` ({process: exit code}), which must die with that code."""
    expected_exit = expected_exit or {}
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(extra_env or {})
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(WORKER)), env.get("PYTHONPATH", "")]
    )
    argv = [sys.executable, WORKER, mode]
    results = run_processes(
        [([*argv, str(i), str(count), port, *map(str, dirs)], env) for i in range(count)],
        TIMEOUT_S,
    )
    for i, (returncode, out) in enumerate(results):
        if i in expected_exit:
            assert returncode == expected_exit[i], f"process {i}:\n{out[-3000:]}"
        else:
            assert f"OK {mode} {i}" in out, f"process {i} exited {returncode}:\n{out[-3000:]}"


@pytest.mark.slow
def test_two_processes_save_retain_overwrite_restore_and_reshard_both_ways(tmp_path):
    saved, back = tmp_path / "two_by_two", tmp_path / "one_by_eight"
    _run_job("save_restore", 2, saved)
    assert sorted(os.listdir(saved)) == ["checkpoint_2.shards"]
    # The overwrite left the index and one piece file per process, all of the new save.
    files = sorted(os.listdir(saved / "checkpoint_2.shards"))
    assert files[0] == "index.safetensors" and len(files) == 3, files
    tokens = {re.fullmatch(r"process_0000[01]\.(.+)\.safetensors", f)[1] for f in files[1:]}
    assert len(tokens) == 1, files
    _run_job("reshard_to_one", 1, saved, back)
    _run_job("reshard_back", 2, back)


@pytest.mark.slow
def test_checkpoint_manager_across_two_processes(tmp_path):
    _run_job("manager", 2, tmp_path)
    assert sorted(os.listdir(tmp_path)) == [
        "checkpoint_2.shards",
        "checkpoint_4.shards",
        "corrupt-checkpoint_4.shards",  # the corrupt step 4, moved aside by the fallback
    ]


@pytest.mark.slow
def test_four_processes_save_and_restore(tmp_path):
    _run_job("save_restore", 4, tmp_path)


@pytest.mark.slow
def test_processes_that_disagree_on_the_tree_fail_everywhere_naming_the_difference(tmp_path):
    """Dtype, global shape, sharding, a host-local leaf only one process has, host-local vs
    global, the tree's structure, the step: each fails on both processes before anything
    is written, and retention deletes nothing."""
    _run_job("disagree", 2, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_2.shards"]


@pytest.mark.slow
def test_a_save_one_process_fails_fails_everywhere_and_the_next_save_pairs_correctly(tmp_path):
    """Before the opening exchange, while planning pieces, or skipping the exchange: the
    save fails on both, the next one works, and an overwrite of a fixed step never mixes
    two saves' rows."""
    _run_job("desync", 2, tmp_path)
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == [
        "checkpoint_4.shards"
    ]


@pytest.mark.slow
def test_peer_dying_mid_save_times_out_and_keeps_previous_checkpoint(tmp_path):
    _run_job("peer_dies", 2, tmp_path, expected_exit={1: 3})
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == [
        "checkpoint_1.shards"
    ]


@pytest.mark.slow
def test_peers_of_a_failed_commit_raise_instead_of_returning(tmp_path):
    _run_job("zero_fails", 2, tmp_path)
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == [
        "checkpoint_1.shards"
    ]


@pytest.mark.slow
def test_two_processes_on_s3_save_then_restore_onto_another_mesh_and_process_count(
    s3_server, s3_bucket
):
    """No shared file system: the processes meet only in the coordination service and the
    bucket (credentials and endpoint from the standard AWS environment variables)."""
    import s3fs

    saved, back = f"{s3_bucket}/two_by_two", f"{s3_bucket}/one_by_eight"
    _run_job("save_restore", 2, saved, extra_env=s3_server.env)
    _run_job("reshard_to_one", 1, saved, back, extra_env=s3_server.env)
    _run_job("reshard_back", 2, back, extra_env=s3_server.env)
    s3 = s3fs.S3FileSystem(**s3_server.storage_options)
    files = sorted(p.rsplit("/", 1)[1] for p in s3.find(saved.split("://")[1]))
    # The overwrite left the index and one piece per process, all of the new save.
    assert files[0] == "index.safetensors" and len(files) == 3, files


@pytest.mark.slow
def test_a_peer_dying_mid_save_to_s3_times_out_naming_it_and_commits_nothing(s3_server, s3_bucket):
    import s3fs

    _run_job("peer_dies", 2, f"{s3_bucket}/run", expected_exit={1: 3}, extra_env=s3_server.env)
    s3 = s3fs.S3FileSystem(**s3_server.storage_options)
    keys = [p.split("/run/", 1)[1] for p in s3.find(s3_bucket.split("://")[1])]
    # Step 1's checkpoint only: process 0 took back its own piece of the abandoned step 2.
    assert {k.split("/")[0] for k in keys} == {"checkpoint_1.shards"}, keys


@pytest.mark.parametrize("pieces", [[[[0, 2]], [[0, 2]]], [[[0, 3]]]], ids=["overlap", "hole"])
def test_pieces_that_do_not_tile_an_array_exactly_once_are_never_committed(
    tmp_path, monkeypatch, pieces
):
    """Whatever the processes write, process 0 checks the index as the reader will before
    it commits: two pieces covering the same half (their volume still adds up) or a piece
    missing fail the save, and the previous checkpoint stays the latest."""
    import numpy as np

    from eqx_train import checkpoints
    from eqx_train.checkpoints import _description, _multiprocess

    real_plan = _multiprocess.plan_pieces
    checkpoints.save_checkpoint_multiprocess(tmp_path, {"x": np.zeros(4)}, 1)

    def plan(tensors, process):
        (tensor,), where = tensors, {}
        planned = []
        for k, ranges in enumerate(pieces):
            shape = tuple(b - a for a, b in ranges)
            name = f"x.piece{k}"
            value = np.ones(shape)
            planned.append(_description.Tensor(name, lambda v=value: v, tensor.dtype, shape))
            where[name] = {"leaf": tensor.name, "index": ranges}
        return planned, where

    monkeypatch.setattr(_multiprocess, "plan_pieces", plan)
    with pytest.raises(RuntimeError, match=r"save_checkpoint_multiprocess: the processes' pieces"):
        checkpoints.save_checkpoint_multiprocess(tmp_path, {"x": np.ones(4)}, 2)
    monkeypatch.setattr(_multiprocess, "plan_pieces", real_plan)
    assert checkpoints.available_steps(tmp_path) == [1]
    restored = checkpoints.restore_checkpoint(tmp_path, {"x": np.ones(4)})
    assert (restored["x"] == 0).all()
