"""`CheckpointManager`'s local tier in one process: which tier each save writes, its own
retention, host state in every tier, the restore's choice of tier and `last_restore`.
(Peer copies and lost hosts: tests/test_checkpoint_tiers_multiprocess.py.)"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_train.checkpoints import CheckpointManager, LastRestore, UnreadableCheckpointWarning
from eqx_train.checkpoints.pipeline import _local_tier
from tests.support.helpers import assert_trees_equal, flip_last_byte


def _state(step):
    return {
        "w": jnp.arange(6.0) * step,
        "key": jax.random.key(step),
        "host": np.full(2, step, np.int32),
        "n": step,
    }


def _run(persistent, local, steps, **kwargs):
    """A training loop that saves when `should_save` says so; the steps saved."""
    saved = []
    with CheckpointManager(
        persistent, local_directory=local, save_interval_steps=4, **kwargs
    ) as mgr:
        for step in steps:
            if mgr.should_save(step):
                mgr.save(step, _state(step), host_state={"position": step * 10})
                saved.append(step)
    return saved


def _local_steps(local):
    return sorted(os.listdir(local))


def test_should_save_says_yes_at_either_tiers_steps_and_save_writes_the_tiers_due(tmp_path):
    persistent, local = tmp_path / "p", tmp_path / "l"
    saved = _run(persistent, local, range(10), local_interval_steps=3, local_keep_latest=10)
    assert saved == [0, 3, 4, 6, 8, 9]
    assert CheckpointManager(persistent).all_steps() == [8]  # keep_latest=1 as before
    # The local tier at its own steps and at the persistent ones.
    assert _local_steps(local) == [f"checkpoint_{s}.local" for s in (0, 3, 4, 6, 8, 9)]


def test_a_save_no_should_save_asked_for_writes_both_tiers(tmp_path):
    persistent, local = tmp_path / "p", tmp_path / "l"
    with CheckpointManager(persistent, local_directory=local, local_interval_steps=5) as mgr:
        mgr.save(1, _state(1))
    assert mgr.all_steps() == [1]
    assert _local_steps(local) == ["checkpoint_1.local"]


def test_the_local_tier_keeps_its_latest_one_by_default(tmp_path):
    local = tmp_path / "l"
    _run(tmp_path / "p", local, range(7), local_interval_steps=1)
    assert _local_steps(local) == ["checkpoint_6.local"]
    assert os.listdir(local / "checkpoint_6.local") == ["process_00000-of-00001.safetensors"]


def test_restore_takes_the_newer_local_step_with_its_host_state(tmp_path):
    persistent, local = tmp_path / "p", tmp_path / "l"
    _run(persistent, local, range(7), local_interval_steps=1)
    mgr = CheckpointManager(persistent, local_directory=local)
    assert mgr.last_restore is None
    restored = mgr.restore(_state(0))
    assert_trees_equal(restored, _state(6))
    report = mgr.last_restore
    assert isinstance(report, LastRestore)
    assert (report.step, report.tier, report.host_state) == (6, "local", {"position": 60})
    assert report.bytes_read["local"] > 0 and report.seconds >= 0


def test_restore_takes_a_newer_persistent_step_over_an_older_local_one(tmp_path):
    persistent, local = tmp_path / "p", tmp_path / "l"
    _run(persistent, local, range(3), local_interval_steps=1)
    with CheckpointManager(persistent) as mgr:  # a job that saved without the local tier
        mgr.save(5, _state(5), host_state=[1, 2])
    mgr = CheckpointManager(persistent, local_directory=local)
    assert_trees_equal(mgr.restore(_state(0)), _state(5))
    report = mgr.last_restore
    assert report is not None
    assert (report.step, report.tier, report.host_state) == (5, "persistent", [1, 2])
    assert set(report.bytes_read) == {"persistent"}


def test_a_corrupt_local_unit_is_skipped_naming_it_and_moved_aside(tmp_path):
    persistent, local = tmp_path / "p", tmp_path / "l"
    _run(persistent, local, range(7), local_interval_steps=1)
    unit = local / "checkpoint_6.local" / "process_00000-of-00001.safetensors"
    flip_last_byte(unit)
    mgr = CheckpointManager(persistent, local_directory=local)
    with pytest.warns(UnreadableCheckpointWarning, match=str(unit)):
        restored = mgr.restore(_state(0))
    assert_trees_equal(restored, _state(4))
    assert mgr.last_restore is not None and mgr.last_restore.tier == "persistent"
    assert os.listdir(unit.parent) == [f"corrupt-{unit.name}"]


def test_a_local_unit_of_another_process_count_is_never_restored(tmp_path):
    persistent, local = tmp_path / "p", tmp_path / "l"
    _run(persistent, local, range(7), local_interval_steps=1)
    step_dir = local / "checkpoint_6.local"
    os.rename(
        step_dir / "process_00000-of-00001.safetensors",
        step_dir / "process_00000-of-00002.safetensors",
    )
    mgr = CheckpointManager(persistent, local_directory=local)
    assert_trees_equal(mgr.restore(_state(0)), _state(4))
    assert mgr.last_restore is not None and mgr.last_restore.tier == "persistent"


def test_a_unit_whose_name_and_contents_disagree_is_corrupt(tmp_path):
    persistent, local = tmp_path / "p", tmp_path / "l"
    _run(persistent, local, range(7), local_interval_steps=1)
    os.rename(local / "checkpoint_6.local", local / "checkpoint_7.local")
    mgr = CheckpointManager(persistent, local_directory=local)
    with pytest.warns(UnreadableCheckpointWarning, match="says step 6"):
        assert_trees_equal(mgr.restore(_state(0)), _state(4))


def test_a_target_the_local_unit_cannot_fill_restores_from_the_persistent_tier(tmp_path):
    persistent, local = tmp_path / "p", tmp_path / "l"
    _run(persistent, local, range(7), local_interval_steps=1)
    mgr = CheckpointManager(persistent, local_directory=local)
    target = {**_state(0), "w": jnp.zeros(6, jnp.int32)}
    with pytest.warns(UnreadableCheckpointWarning, match="leaf .* was saved as"):
        with pytest.raises(ValueError, match="does not match the target"):  # nor persistent
            mgr.restore(target)


def test_a_write_that_fails_midway_leaves_no_unit_and_the_previous_step_restores(
    tmp_path, monkeypatch
):
    persistent, local = tmp_path / "p", tmp_path / "l"
    _run(persistent, local, range(3), local_interval_steps=1, local_keep_latest=2)
    real = _local_tier.write_all

    def fail_halfway(fd, data):
        real(fd, data[: len(data) // 2])
        raise OSError("disk full")

    monkeypatch.setattr(_local_tier, "write_all", fail_halfway)
    with CheckpointManager(persistent, local_directory=local, local_interval_steps=1) as mgr:
        assert mgr.should_save(3)
        with pytest.raises(OSError, match="disk full"):
            mgr.save(3, _state(3))
    monkeypatch.undo()
    assert os.listdir(local / "checkpoint_3.local") == []
    mgr = CheckpointManager(persistent, local_directory=local)
    assert_trees_equal(mgr.restore(_state(0)), _state(2))
    assert mgr.last_restore is not None and mgr.last_restore.tier == "local"


def test_an_async_manager_writes_the_local_tier_in_the_background(tmp_path):
    persistent, local = tmp_path / "p", tmp_path / "l"
    _run(persistent, local, range(6), local_interval_steps=1, async_save=True)
    mgr = CheckpointManager(persistent, local_directory=local)
    assert_trees_equal(mgr.restore(_state(0)), _state(5))
    assert mgr.last_restore is not None and mgr.last_restore.host_state == {"position": 50}


def test_host_state_must_be_json(tmp_path):
    with CheckpointManager(tmp_path / "p", local_directory=tmp_path / "l") as mgr:
        with pytest.raises(TypeError, match="host_state must be JSON-serialisable"):
            mgr.save(0, _state(0), host_state=object())


def test_a_persistent_restore_reports_its_step_and_host_state_without_a_local_tier(tmp_path):
    with CheckpointManager(tmp_path, keep_latest=3) as mgr:
        mgr.restore(_state(0))
        assert mgr.last_restore is not None and mgr.last_restore.step is None
        for step in (1, 2):
            mgr.save(step, _state(step), host_state={"at": step})
        mgr.restore(_state(0), step=1)
        assert mgr.last_restore is not None
        assert (mgr.last_restore.step, mgr.last_restore.host_state) == (1, {"at": 1})
        mgr.restore(_state(0))
        assert (mgr.last_restore.step, mgr.last_restore.tier) == (2, "persistent")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"local_interval_steps": 2}, "local_interval_steps=2 needs local_directory"),
        ({"local_directory": "l", "local_interval_steps": 0}, "local_interval_steps must"),
        ({"local_directory": "l", "peer_replicas": -1}, "peer_replicas must be an int >= 0"),
        ({"local_directory": "l", "local_keep_latest": 0}, "local_keep_latest must be"),
    ],
)
def test_local_tier_options_are_checked_at_construction(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        CheckpointManager(tmp_path, **kwargs)
