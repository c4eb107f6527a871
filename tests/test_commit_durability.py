"""A save returns only once every entry it created is durable on any POSIX file system:
the parent directory of each new file and directory was fsynced after the entry appeared
in it, before the save returned."""

import os
import stat

import numpy as np
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints import CheckpointManager


@pytest.fixture
def synced(monkeypatch):
    """Each fsync of a directory, as (its path, the names in it then)."""
    seen: list[tuple[str, set[str]]] = []
    real_fsync = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            path = os.readlink(f"/proc/self/fd/{fd}")
            seen.append((path, set(os.listdir(path))))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def _entries(root):
    found = set()
    for directory, dirs, files in os.walk(root):
        found |= {os.path.join(directory, name) for name in dirs + files}
    return found


def _tree(step):
    return {"w": np.full(4, float(step), np.float32), "n": step}


def _save_file(root):
    checkpoints.save_checkpoint(root / "runs" / "a", _tree(1), 1)


def _save_shards(root):
    checkpoints.save_checkpoint_multiprocess(root / "runs", _tree(1), 1)


def _save_shards_overwrite_and_retain(root):
    for step in (1, 2):
        checkpoints.save_checkpoint_multiprocess(root, _tree(step), step, keep=1)


def _manager_save(root):
    manager = CheckpointManager(root / "runs" / "m", keep_latest=1, handle_sigterm=False)
    manager.save(1, _tree(1))
    manager.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names fds through /proc")
@pytest.mark.parametrize(
    "save", [_save_file, _save_shards, _save_shards_overwrite_and_retain, _manager_save]
)
def test_every_new_entry_is_fsynced_in_its_parent_before_the_save_returns(tmp_path, synced, save):
    root = tmp_path.resolve() / "root"
    root.mkdir()
    before = _entries(root)
    save(root)
    new = _entries(root) - before
    assert new
    unsynced = sorted(
        entry
        for entry in new
        if not any(
            path == os.path.dirname(entry) and os.path.basename(entry) in names
            for path, names in synced
        )
    )
    assert not unsynced, f"not fsynced in their parent: {unsynced}"
