"""Multi-process checkpoints with real jax.distributed processes on loopback."""

import json
import os
import re
import shutil
import sys
from typing import cast

import pytest

from tests.support.helpers import SUPPORT, free_port, run_processes, worker_env

WORKER = os.path.join(SUPPORT, "multiprocess_worker.py")
TIMEOUT_S = 90


def _run_job(mode, count, *dirs, expected_exit=None, extra_env=None):
    """Runs `count` worker processes; each must print its OK line, except the processes in
    `expected_exit` ({process: exit code}), which must die with that code. Returns each
    process's output."""
    expected_exit = expected_exit or {}
    port = str(free_port())
    env = worker_env(**(extra_env or {}))
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
    return [out for _, out in results]


@pytest.mark.slow
def test_two_processes_save_retain_overwrite_restore_and_reshard_both_ways(tmp_path):
    saved, back = tmp_path / "two_by_two", tmp_path / "one_by_eight"
    _run_job("save_restore", 2, saved)
    assert sorted(os.listdir(saved)) == ["checkpoint_2.shards"]
    # The overwrite left the index and one piece file per process, all of the new save.
    files = sorted(os.listdir(saved / "checkpoint_2.shards"))
    assert files[0] == "index.safetensors" and len(files) == 3, files
    tokens = {
        cast(re.Match, re.fullmatch(r"process_0000[01]\.(.+)\.safetensors", f))[1]
        for f in files[1:]
    }
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
    from eqx_train.checkpoints.format import _description
    from eqx_train.checkpoints.pipeline import _multiprocess

    real_plan = _multiprocess.plan_pieces
    checkpoints.save_checkpoint_multiprocess(tmp_path, {"x": np.zeros(4)}, 1)

    def plan(tensors, process, **options):
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


# Replica-parallel saves and read-once restores: the worker's "rp_" modes run one device per
# process (one host each) on the tree of `rp_tree`: 'rep' float32[64, 32] and the model's
# float32[3, 4] weight replicated on every process, 'part' bfloat16[64, 32] sharded over 2
# processes and replicated over the others, and host-local leaves (float32[16], an int).
REPLICATED = 64 * 32 * 4 + 3 * 4 * 4
PART = 64 * 32 * 2
HOST_LOCAL = 16 * 4 + 8
FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "pre_replica_parallel_2proc.shards")


def _written(shards_dir):
    """The tensor bytes in each process's piece file, from the safetensors headers."""
    written = {}
    for name in os.listdir(shards_dir):
        match = re.fullmatch(r"process_(\d+)\..+\.safetensors", name)
        if match:
            with open(os.path.join(shards_dir, name), "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            written[int(match[1])] = sum(
                end - start
                for key, entry in header.items()
                if key != "__metadata__"
                for start, end in [entry["data_offsets"]]
            )
    return written


def _read(outputs, label="READ"):
    """The piece bytes each process says it read (its `label` line)."""
    return [
        int(cast(re.Match, re.search(rf"^{label} \d+ (\d+)$", out, re.M))[1]) for out in outputs
    ]


def _arrays_table(shards_dir):
    """The index's piece table, with the save's token taken out of the file names."""
    with open(os.path.join(shards_dir, "index.safetensors"), "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    text = header["__metadata__"]["eqx_train.arrays"]
    return json.loads(re.sub(r"process_(\d+)\.[^.\"]+\.safetensors", r"process_\1", text))


def test_two_processes_each_write_and_read_half_of_a_replicated_state(tmp_path):
    """By default each process writes half of every replicated block and, restoring, reads
    only that half (one resharding brings the other half over gloo): bit-exact, with the
    bytes of each piece file and of each process's reads equal to the share computed here.
    With replica_parallel=False on restore, each reads the whole of what it holds."""
    outputs = _run_job("rp_save", 2, tmp_path, "and_without")
    shards = tmp_path / "checkpoint_5.shards"
    share = (REPLICATED + PART) // 2
    assert _written(shards) == {0: share + HOST_LOCAL, 1: share}
    assert _read(outputs) == [share + HOST_LOCAL] * 2
    assert _read(outputs, "READ_ALL") == [REPLICATED + PART // 2 + HOST_LOCAL] * 2


def test_a_checkpoint_written_before_replica_parallel_saves_restores_bit_exactly(tmp_path):
    """The fixture was written by the code before this change (process 0 wrote every
    replicated block whole): it restores onto two processes by default, each reading the
    whole pieces its share lies in (a verified read reads a piece whole)."""
    shutil.copytree(FIXTURE, tmp_path / "old.shards")
    outputs = _run_job("rp_restore", 2, tmp_path / "old.shards", 5)
    assert _read(outputs) == [REPLICATED + PART // 2 + HOST_LOCAL] * 2


@pytest.mark.slow
def test_replica_parallel_false_writes_the_layout_of_before(tmp_path):
    """Process 0 writes every replicated block whole, the others their own shards only,
    and the index's piece table is the fixture's, file for file."""
    _run_job("rp_save", 2, tmp_path, extra_env={"RP": "0"})
    shards = tmp_path / "checkpoint_5.shards"
    assert _written(shards) == {0: REPLICATED + PART // 2 + HOST_LOCAL, 1: PART // 2}
    assert _arrays_table(shards) == _arrays_table(FIXTURE)


def test_a_manager_with_replica_parallel_false_writes_and_reads_as_before(tmp_path):
    """`CheckpointManager(replica_parallel=False)`: process 0 writes every replicated block
    whole, and restoring, each process reads all the blocks it holds."""
    outputs = _run_job("rp_manager", 2, tmp_path)
    written = _written(tmp_path / "checkpoint_5.shards")
    assert written == {0: REPLICATED + PART // 2 + HOST_LOCAL, 1: PART // 2}
    assert _read(outputs) == [REPLICATED + PART // 2 + HOST_LOCAL] * 2


@pytest.mark.slow
def test_four_processes_split_every_replica_and_restore_onto_two_and_one(tmp_path):
    """Replicated blocks cost each of 4 processes a quarter; a block sharded over 2 and
    replicated over 2 costs each holder half of it (a quarter of the array). Restored onto
    4, 2 and 1 processes bit-exactly, each process reading its share and no more."""
    outputs = _run_job("rp_save", 4, tmp_path, "and_without")
    shards = tmp_path / "checkpoint_5.shards"
    share = (REPLICATED + PART) // 4
    assert _written(shards) == {0: share + HOST_LOCAL, 1: share, 2: share, 3: share}
    assert _read(outputs) == [share + HOST_LOCAL] * 4
    assert _read(outputs, "READ_ALL") == [REPLICATED + PART // 2 + HOST_LOCAL] * 4
    two = _run_job("rp_restore", 2, shards, 5)
    assert _read(two) == [(REPLICATED + PART) // 2 + HOST_LOCAL] * 2
    one = _run_job("rp_restore", 1, shards, 5)
    assert _read(one) == [REPLICATED + PART + HOST_LOCAL]


def test_processes_that_list_different_latest_checkpoints_never_mix_them_in_one_array(
    tmp_path,
):
    """A save lands between two processes' listings (a trainer saving while a multi-process
    job restores the latest): each process reads its share of the block from the checkpoint
    it listed. The read-once exchange compares what they opened, so they look again and
    agree on step 2, instead of assembling rows of step 2 and of step 1 into one array."""
    _run_job("rp_race", 2, tmp_path)


def test_a_restore_one_process_makes_alone_leaves_the_next_ones_reading_once(tmp_path):
    """Process 0 restores without its peer (it waits out the shortened timeout and reads
    everything): the two processes' later restores still meet, each reading only its
    share and with no warning, instead of one waiting out the timeout every time."""
    outputs = _run_job("rp_lone", 2, tmp_path)
    share = (REPLICATED + PART) // 2 + HOST_LOCAL
    reads = [re.findall(r"^READ \d+ (\d+)$", out, re.M) for out in outputs]
    assert reads == [[str(share)] * 2] * 2, reads


@pytest.mark.slow
def test_read_once_restores_beside_renamed_tied_and_cast_leaves_in_two_processes(tmp_path):
    """A renamed replicated leaf is read once; two leaves tied to one tensor and a leaf cast
    from bfloat16 are read block by block beside it: all bit-exact, in their shardings.
    Typed PRNG keys replicated on both processes are saved split between them too."""
    _run_job("rp_rename", 2, tmp_path)


def test_a_capped_proxy_holds_its_rate_and_counts_every_byte_each_way(s3_server, s3_bucket):
    """The benchmark's host link: 256 KiB up and back down at 1 MiB/s take 0.25 s each way
    (0.2 s at least, a 50 ms burst allowed), and the counters hold the bodies plus no more
    than the requests' heads."""
    import time

    import s3fs

    from tests.support.fault_proxy import FaultProxy

    body = os.urandom(256 << 10)
    with FaultProxy(s3_server.endpoint_url, rate_bytes_per_s=1 << 20) as proxy:
        options = {**s3_server.storage_options}
        options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": proxy.url}
        s3 = s3fs.S3FileSystem(**options, skip_instance_cache=True)
        key = f"{s3_bucket.split('://')[1]}/capped"
        start = time.perf_counter()
        s3.pipe_file(key, body)
        up_s, up = time.perf_counter() - start, proxy.bytes_up
        start = time.perf_counter()
        assert s3.cat_file(key) == body
        down_s, down = time.perf_counter() - start, proxy.bytes_down
    # 0.25 s at the rate, less the 50 ms burst the proxy lets through after a late sleep.
    assert up_s >= 0.19 and down_s >= 0.19, (up_s, down_s)
    assert len(body) <= up <= len(body) + (32 << 10), up
    assert len(body) <= down <= len(body) + (32 << 10), down
