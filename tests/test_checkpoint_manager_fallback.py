"""What `CheckpointManager.restore`'s fallback leaves behind: a checkpoint it skipped as
unreadable (corrupt, or a disk read error) is moved aside, whole, under a name no listing
counts, so that the run resuming from the older one saves that step again; and a disk read
error is a fallback, named by file, like corruption."""

import ctypes
import errno
import os
import re
import warnings

import numpy as np
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints import CheckpointManager, UnreadableCheckpointWarning
from eqx_train.checkpoints.pipeline import _directory
from eqx_train.checkpoints.storage import _local, _local_files
from tests.support.helpers import flip_last_byte
from tests.test_docs_examples import DOCS, _blocks


def _state(step):
    return {"w": np.full(4, float(step), np.float32)}


def _saved(directory, steps, **options):
    manager = CheckpointManager(directory, keep_latest=len(steps), handle_sigterm=False, **options)
    for step in steps:
        manager.save(step, _state(step))
    manager.close()


def test_a_skipped_corrupt_checkpoint_is_moved_aside_whole_and_its_step_saves_again(tmp_path):
    _saved(tmp_path, [5, 6, 7])
    bad = tmp_path / "checkpoint_7.safetensors"
    flip_last_byte(bad)
    evidence = bad.read_bytes()
    manager = CheckpointManager(tmp_path, keep_latest=3, handle_sigterm=False)
    with pytest.warns(UnreadableCheckpointWarning) as caught:
        restored = manager.restore(_state(0))
    np.testing.assert_array_equal(restored["w"], np.full(4, 6.0))
    moved = tmp_path / "corrupt-checkpoint_7.safetensors"
    [message] = [str(w.message) for w in caught]
    assert str(bad) in message and str(moved) in message
    assert moved.read_bytes() == evidence  # never deleted, never changed
    assert manager.all_steps() == [5, 6]
    manager.save(7, _state(70))  # was: "a checkpoint at step 7 already exists"
    np.testing.assert_array_equal(manager.restore(_state(0))["w"], np.full(4, 70.0))
    assert moved.read_bytes() == evidence  # retention never touches it


def test_should_save_saves_the_step_of_a_checkpoint_the_fallback_skipped(tmp_path):
    _saved(tmp_path, [6, 7])
    flip_last_byte(tmp_path / "checkpoint_7.safetensors")
    manager = CheckpointManager(tmp_path, keep_latest=2, save_interval_steps=1)
    assert not manager.should_save(7)  # before the restore, step 7 looks saved
    with pytest.warns(UnreadableCheckpointWarning):
        manager.restore(_state(0))
    assert manager.should_save(7)  # the resumed run redoes step 7: it must save it
    manager.close()


def test_a_second_corrupt_copy_of_a_step_is_moved_aside_under_a_new_name(tmp_path):
    _saved(tmp_path, [6, 7])
    (tmp_path / "corrupt-checkpoint_7.safetensors").write_bytes(b"an earlier one")
    flip_last_byte(tmp_path / "checkpoint_7.safetensors")
    manager = CheckpointManager(tmp_path, keep_latest=2, handle_sigterm=False)
    with pytest.warns(UnreadableCheckpointWarning, match="corrupt-2-checkpoint_7"):
        manager.restore(_state(0))
    assert (tmp_path / "corrupt-checkpoint_7.safetensors").read_bytes() == b"an earlier one"
    assert (tmp_path / "corrupt-2-checkpoint_7.safetensors").exists()


def test_a_skipped_shards_checkpoint_is_moved_aside_whole(tmp_path):
    checkpoints.save_checkpoint_multiprocess(tmp_path, _state(6), 6)
    bad = checkpoints.save_checkpoint_multiprocess(tmp_path, _state(7), 7, keep=2)
    [piece] = [n for n in os.listdir(bad) if n != "index.safetensors"]
    flip_last_byte(os.path.join(bad, piece))
    manager = CheckpointManager(tmp_path, keep_latest=2, handle_sigterm=False)
    with pytest.warns(UnreadableCheckpointWarning, match="corrupt-checkpoint_7.shards"):
        np.testing.assert_array_equal(manager.restore(_state(0))["w"], np.full(4, 6.0))
    moved = tmp_path / "corrupt-checkpoint_7.shards"
    assert sorted(os.listdir(moved)) == sorted(["index.safetensors", piece])
    assert manager.all_steps() == [6]
    checkpoints.save_checkpoint_multiprocess(tmp_path, _state(7), 7, keep=2)  # unblocked
    assert manager.all_steps() == [6, 7]


def _flip_last_byte(store, path):
    source = store.open(path)
    data = bytearray(source.size)
    source.read_into(memoryview(data), 0)
    source.close()
    data[-1] ^= 0xFF
    store.atomic_write(path, lambda stream: stream.write(bytes(data)))
    return bytes(data)


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "shards"])
def test_a_skipped_checkpoint_on_an_object_store_is_moved_aside_whole(tmp_path, sharded):
    url = f"memory://fallback-{tmp_path.name}"
    if sharded:
        for step in (6, 7):
            checkpoints.save_checkpoint_multiprocess(url, _state(step), step, keep=2)
    else:
        _saved(url, [6, 7])
    manager = CheckpointManager(url, keep_latest=2, handle_sigterm=False)
    store = manager._store
    name = "checkpoint_7.shards" if sharded else "checkpoint_7.safetensors"
    bad = store.join(manager.directory, name)
    files = [item.name for item in store.list(bad)] if sharded else [""]
    pieces = {f: store.join(bad, f) if f else bad for f in files}
    corrupted = {f: _flip_last_byte(store, p) for f, p in pieces.items() if "process" in f or not f}
    with pytest.warns(UnreadableCheckpointWarning, match=f"corrupt-{name}"):
        manager.restore(_state(0))
    assert manager.all_steps() == [6]
    moved = store.join(manager.directory, f"corrupt-{name}")
    for f, data in corrupted.items():
        copy = store.join(moved, f) if f else moved
        source = store.open(copy)
        kept = bytearray(source.size)
        source.read_into(memoryview(kept), 0)
        source.close()
        assert bytes(kept) == data  # the evidence, byte for byte
    if sharded:
        assert sorted(item.name for item in store.list(moved)) == sorted(files)
    manager.save(7, _state(7))
    assert manager.all_steps() == [6, 7]


def test_the_exact_resume_recipe_resumes_past_a_corrupt_newest_checkpoint(tmp_path):
    """docs/resuming_exactly.md's `train`, run as written: stopped after 7 steps, its
    newest checkpoint (step 7) damaged, then run again. It falls back to step 6 and must
    save step 7 again and finish."""
    page = DOCS / "resuming_exactly.md"
    [(line, _, recipe), *_] = _blocks(page.read_text(), str(page))
    namespace: dict = {}
    exec(compile("\n" * (line - 1) + recipe, str(page), "exec"), namespace)
    workdir = str(tmp_path)
    namespace["train"](workdir, stop_after=7)
    flip_last_byte(tmp_path / "checkpoint_7.safetensors")
    with pytest.warns(UnreadableCheckpointWarning, match="checkpoint_7"):
        carry = namespace["train"](workdir)
    assert int(carry["position"]) == namespace["STEPS"]
    assert (tmp_path / "corrupt-checkpoint_7.safetensors").exists()


# ---------------------------------------------------------------- disk read errors


@pytest.fixture
def eio_reading(monkeypatch):
    """Makes every read of the named file fail with EIO, as a failing disk does."""
    failing = []
    real = os.preadv

    def preadv(fd, buffers, offset):
        if os.path.realpath(f"/proc/self/fd/{fd}") in failing:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset)

    monkeypatch.setattr(_local.os, "preadv", preadv)
    return lambda path: failing.append(os.path.realpath(path))


def test_a_disk_read_error_in_restore_checkpoint_names_the_file(tmp_path, eio_reading):
    path = checkpoints.save_checkpoint(tmp_path, _state(1), 1)
    eio_reading(path)
    with pytest.raises(OSError, match=re.escape(path)) as raised:
        checkpoints.restore_checkpoint(tmp_path, _state(0))
    assert raised.value.errno == errno.EIO


def test_a_disk_read_error_in_the_newest_checkpoint_falls_back_naming_the_file(
    tmp_path, eio_reading
):
    _saved(tmp_path, [6, 7])
    bad = str(tmp_path / "checkpoint_7.safetensors")
    eio_reading(bad)
    manager = CheckpointManager(tmp_path, keep_latest=2, handle_sigterm=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = manager.restore(_state(0))
    np.testing.assert_array_equal(restored["w"], np.full(4, 6.0))
    [warning] = caught
    assert warning.category is UnreadableCheckpointWarning
    assert f"{bad} (" in str(warning.message) and "Input/output error" in str(warning.message)


def test_a_prefix_that_would_list_checkpoints_moved_aside_is_refused(tmp_path):
    # Its retention could otherwise delete what a manager of `checkpoint_` moved aside.
    with pytest.raises(ValueError, match="starts with 'corrupt-'"):
        CheckpointManager(tmp_path, prefix="corrupt-checkpoint_")


def test_moving_aside_never_replaces_a_file_that_took_the_name_after_the_check(
    tmp_path, monkeypatch
):
    # Another process (or a person) creates corrupt-checkpoint_7 between the check that the
    # name is free and the rename: the file it made is kept and the next name is used.
    _saved(tmp_path, [6, 7])
    flip_last_byte(tmp_path / "checkpoint_7.safetensors")
    intruder = tmp_path / "corrupt-checkpoint_7.safetensors"
    real_exists = _local.LocalStorage.exists

    def exists(self, path):
        free = real_exists(self, path)
        if path == str(intruder) and free is False:
            intruder.write_bytes(b"not yours")  # lands right after the check
        return free

    monkeypatch.setattr(_local.LocalStorage, "exists", exists)
    # A rename that checked first would replace it, as os.rename does: the check passes.
    monkeypatch.setattr(os.path, "lexists", lambda path: False)
    manager = CheckpointManager(tmp_path, keep_latest=2, handle_sigterm=False)
    with pytest.warns(UnreadableCheckpointWarning) as caught:
        restored = manager.restore(_state(0))
    np.testing.assert_array_equal(restored["w"], np.full(4, 6.0))
    assert intruder.read_bytes() == b"not yours"
    [message] = [str(w.message) for w in caught]
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("corrupt-") and p != intruder]
    assert len(moved) == 1 and str(moved[0]) in message
    manager.close()


@pytest.mark.skipif(_local_files._RENAMEAT2 is None, reason="renameat2 is Linux-only")
def test_a_local_move_refuses_a_destination_that_appeared_after_any_check(tmp_path, monkeypatch):
    source, taken = tmp_path / "a", tmp_path / "b"
    source.write_bytes(b"a")
    taken.write_bytes(b"b")
    monkeypatch.setattr(os.path, "lexists", lambda path: False)  # every check says "free"
    with pytest.raises(FileExistsError, match="b"):
        _local.LocalStorage().move(str(source), str(taken))
    assert taken.read_bytes() == b"b" and source.read_bytes() == b"a"


def test_a_save_that_replaces_the_corrupt_file_just_before_it_is_moved_aside_stays_listed(
    tmp_path, monkeypatch
):
    # Another process saves step 7 again between the check that the corrupt version is still
    # there and the move: the move takes the new save, which is then put back.
    _saved(tmp_path, [6, 7])
    flip_last_byte(tmp_path / "checkpoint_7.safetensors")
    real = _directory.quarantine

    def quarantine(store, ckpt_dir, entry):
        checkpoints.save_checkpoint(tmp_path, _state(70), 7, overwrite=True, keep=10)
        return real(store, ckpt_dir, entry)

    monkeypatch.setattr(_directory, "quarantine", quarantine)
    manager = CheckpointManager(tmp_path, keep_latest=2, handle_sigterm=False)
    with pytest.warns(UnreadableCheckpointWarning, match="new save was left under its name"):
        np.testing.assert_array_equal(manager.restore(_state(0))["w"], np.full(4, 6.0))
    monkeypatch.undo()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("corrupt-")]
    assert manager.all_steps() == [6, 7]
    np.testing.assert_array_equal(manager.restore(_state(0))["w"], np.full(4, 70.0))
    manager.close()


@pytest.mark.parametrize("kernel", ["no renameat2", "a file system without the flag"])
def test_a_local_move_without_rename_noreplace_still_refuses_an_existing_destination(
    tmp_path, monkeypatch, kernel
):
    if kernel == "no renameat2":
        monkeypatch.setattr(_local_files, "_RENAMEAT2", None)
    else:

        def renameat2(*args):
            ctypes.set_errno(errno.EINVAL)  # what such a file system answers
            return -1

        monkeypatch.setattr(_local_files, "_RENAMEAT2", renameat2)
    source, taken, free = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    source.write_bytes(b"a")
    taken.write_bytes(b"b")
    with pytest.raises(FileExistsError):
        _local.LocalStorage().move(str(source), str(taken))
    assert taken.read_bytes() == b"b" and source.read_bytes() == b"a"
    _local.LocalStorage().move(str(source), str(free))
    assert free.read_bytes() == b"a" and not source.exists()
