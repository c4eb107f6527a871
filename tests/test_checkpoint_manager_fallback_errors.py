"""The manager's fallback, by the kind of error: only errors that say the checkpoint itself is
unreadable make it skipped and moved aside. An error of the process or the machine (too
many open files, no memory, a permission) says nothing about the newest checkpoint: it
is raised, and the checkpoint stays where it is, listed."""

import errno
import os
import warnings

import numpy as np
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints import CheckpointManager
from eqx_train.checkpoints.manager import _manager
from eqx_train.checkpoints.storage import _local
from tests.support.helpers import flip_last_byte


def _state(step):
    return {"w": np.full(4, float(step), np.float32)}


def _saved(directory, steps):
    manager = CheckpointManager(directory, keep_latest=len(steps), handle_sigterm=False)
    for step in steps:
        manager.save(step, _state(step))
    manager.close()


@pytest.fixture
def failing_reads(monkeypatch):
    """Makes every read of the named file fail with the given errno."""
    failing = {}
    real = os.preadv

    def preadv(fd, buffers, offset):
        code = failing.get(os.path.realpath(f"/proc/self/fd/{fd}"))
        if code is not None:
            raise OSError(code, os.strerror(code))
        return real(fd, buffers, offset)

    monkeypatch.setattr(_local.os, "preadv", preadv)
    return lambda path, code: failing.__setitem__(os.path.realpath(path), code)


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENOMEM, errno.EACCES, errno.EINTR])
def test_an_error_of_the_process_not_the_disk_is_raised_and_moves_nothing(
    tmp_path, failing_reads, code
):
    _saved(tmp_path, [6, 7])
    newest = tmp_path / "checkpoint_7.safetensors"
    failing_reads(newest, code)
    manager = CheckpointManager(tmp_path, keep_latest=2, handle_sigterm=False)
    with pytest.raises(OSError) as raised:
        manager.restore(_state(0))
    assert raised.value.errno == code and str(newest) in str(raised.value)
    assert newest.exists() and manager.all_steps() == [6, 7]
    assert not [p for p in os.listdir(tmp_path) if p.startswith("corrupt-")]


def test_a_disk_read_error_still_falls_back(tmp_path, failing_reads):
    _saved(tmp_path, [6, 7])
    failing_reads(tmp_path / "checkpoint_7.safetensors", errno.EIO)
    manager = CheckpointManager(tmp_path, keep_latest=2, handle_sigterm=False)
    with pytest.warns(checkpoints.UnreadableCheckpointWarning, match="Input/output error"):
        restored = manager.restore(_state(0))
    np.testing.assert_array_equal(restored["w"], np.full(4, 6.0))


@pytest.mark.parametrize("sharded", [False, True])
def test_a_checkpoint_saved_again_while_another_manager_fell_back_past_it_stays(
    tmp_path, monkeypatch, sharded
):
    # Manager B finds step 7 corrupt and restores step 6. Meanwhile (a hook in B's restore
    # of step 6, so the race is certain) manager A moves the corrupt step 7 aside and saves
    # a good step 7. B must not then move A's good step 7 aside as the corrupt one.
    save = checkpoints.save_checkpoint_multiprocess if sharded else checkpoints.save_checkpoint
    for step in (6, 7):
        save(tmp_path, _state(step), step, keep=3)
    suffix = ".shards" if sharded else ".safetensors"
    newest = tmp_path / f"checkpoint_7{suffix}"
    pieces = [p for p in newest.glob("*.safetensors") if p.name != "index.safetensors"]
    flip_last_byte(pieces[0] if sharded else newest)
    real_restore = _manager.restore_entry

    def restore_entry(store, entry, target, options):
        if entry.step == 6:  # B has skipped step 7: A acts now
            os.rename(newest, tmp_path / f"corrupt-checkpoint_7{suffix}")
            save(tmp_path, _state(70), 7, keep=3)
        return real_restore(store, entry, target, options)

    monkeypatch.setattr(_manager, "restore_entry", restore_entry)
    b = CheckpointManager(tmp_path, keep_latest=3, handle_sigterm=False)
    with pytest.warns(checkpoints.UnreadableCheckpointWarning, match="replaced") as caught:
        b.restore(_state(0))
    assert str(newest) in str(caught[0].message)
    monkeypatch.setattr(_manager, "restore_entry", real_restore)
    assert b.all_steps() == [6, 7]
    np.testing.assert_array_equal(b.restore(_state(0))["w"], np.full(4, 70.0))


@pytest.mark.parametrize("code", [errno.EMFILE, errno.EACCES])
def test_retention_never_deletes_the_best_checkpoint_for_an_error_of_the_process(
    tmp_path, failing_reads, code
):
    # Reading the best checkpoint's metrics fails with an error that says nothing about
    # it: it must not count as having no metric (and so be deleted as neither latest nor
    # best); the save raises instead, and the best stays.
    manager = CheckpointManager(
        tmp_path, keep_latest=1, keep_best=1, best_metric="loss", handle_sigterm=False
    )
    for step, loss in [(1, 0.1), (2, 0.5)]:
        manager.save(step, _state(step), metrics={"loss": loss})
    best = tmp_path / "checkpoint_1.safetensors"
    failing_reads(best, code)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", checkpoints.UnreadableCheckpointWarning)
        with pytest.raises(OSError, match=str(best)) as raised:
            manager.save(3, _state(3), metrics={"loss": 0.9})
    manager.close()
    assert best.exists()
    assert "nothing was deleted" in "\n".join(raised.value.__notes__)


def test_retention_counts_a_checkpoint_with_a_disk_read_error_as_having_no_metric(
    tmp_path, failing_reads
):
    manager = CheckpointManager(
        tmp_path, keep_latest=1, keep_best=1, best_metric="loss", handle_sigterm=False
    )
    for step, loss in [(1, 0.1), (2, 0.5)]:
        manager.save(step, _state(step), metrics={"loss": loss})
    failing_reads(tmp_path / "checkpoint_1.safetensors", errno.EIO)
    with pytest.warns(checkpoints.UnreadableCheckpointWarning, match="Input/output error"):
        manager.save(3, _state(3), metrics={"loss": 0.9})
    manager.close()
    assert manager.all_steps() == [2, 3]


def test_the_unreadable_metrics_warning_points_at_the_save_that_ranked(tmp_path, failing_reads):
    manager = CheckpointManager(
        tmp_path, keep_latest=1, keep_best=1, best_metric="loss", handle_sigterm=False
    )
    for step, loss in [(1, 0.1), (2, 0.5)]:
        manager.save(step, _state(step), metrics={"loss": loss})
    failing_reads(tmp_path / "checkpoint_1.safetensors", errno.EIO)
    with pytest.warns(checkpoints.UnreadableCheckpointWarning) as caught:
        manager.save(3, _state(3), metrics={"loss": 0.9})
    manager.close()
    assert caught[0].filename == __file__


def test_a_disk_read_error_in_a_piece_of_a_shards_checkpoint_falls_back_naming_the_piece(
    tmp_path, failing_reads
):
    for step in (6, 7):
        checkpoints.save_checkpoint_multiprocess(tmp_path, _state(step), step, keep=2)
    newest = tmp_path / "checkpoint_7.shards"
    [piece] = [p for p in newest.iterdir() if p.name.startswith("process_")]
    failing_reads(piece, errno.EIO)
    manager = CheckpointManager(tmp_path, keep_latest=2, handle_sigterm=False)
    with pytest.warns(checkpoints.UnreadableCheckpointWarning) as caught:
        restored = manager.restore(_state(0))
    np.testing.assert_array_equal(restored["w"], np.full(4, 6.0))
    assert str(piece) in str(caught[0].message)
    assert (tmp_path / "corrupt-checkpoint_7.shards" / piece.name).exists()
