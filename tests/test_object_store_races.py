"""Object-store cleanup and failure paths that a real server cannot be made to show on
demand: an S3-like client whose listings, uploads and deletes a test controls (multipart
uploads, If-None-Match, connection errors), over fsspec's memory store."""

import errno
import itertools
import os
import time
import types
import warnings
from typing import Any, cast

import botocore.exceptions
import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from eqx_train import checkpoints
from eqx_train.checkpoints.format import _names
from eqx_train.checkpoints.pipeline import _directory, _restore
from eqx_train.checkpoints.storage import _fsspec


class FakeUpload:
    """An s3fs-like upload: buffered, multipart once it holds a part, committed on close
    ("xb": refused if the key exists by then)."""

    ids = itertools.count()

    def __init__(self, fs, key, mode, block_size):
        self.fs, self.key, self.mode, self.block_size = fs, key, mode, block_size
        self.data, self.closed, self.mpu = bytearray(), False, None

    def write(self, chunk):
        self.data += bytes(chunk)
        if len(self.data) >= self.block_size and self.mpu is None:
            self.mpu = {"UploadId": f"u{next(self.ids)}"}
            self.fs.uploads[self.mpu["UploadId"]] = self.key
        return len(chunk)

    def discard(self):
        if self.mpu:
            self.fs.uploads.pop(self.mpu["UploadId"], None)

    def close(self):
        try:
            if "x" in self.mode and self.fs.refuse_conditions:
                raise OSError(errno.ENOSYS, "501 Not Implemented")
            if "x" in self.mode and self.fs.mem.exists(self.key):
                raise OSError(errno.EINVAL, "At least one of the pre-conditions did not hold")
            self.fs.mem.pipe_file(self.key, bytes(self.data))
            if self.mpu:
                self.fs.uploads.pop(self.mpu["UploadId"], None)
        finally:
            self.closed = True


class FakeS3:
    def __init__(self):
        self.mem = MemoryFileSystem()
        self.mem.rm("/", recursive=True)
        self.uploads = {}  # upload id -> key
        self.listed_uploads = []  # what list_multipart_uploads returns besides self.uploads
        self.on_list_uploads = lambda: None
        self.refuse_conditions = False
        self.fail_rm = None
        self.opened_modes = []

    def _strip_protocol(self, path):
        return self.mem._strip_protocol(path.replace("s3://", "memory://"))

    def invalidate_cache(self, path=None):
        pass

    def ls(self, path, detail=True):
        return self.mem.ls(path, detail=detail)

    def find(self, path, prefix="", detail=False):
        found = cast(dict, self.mem.find(path, detail=True))  # detail=True: a dict
        start = path.rstrip("/") + "/" + prefix
        found = {k: v for k, v in found.items() if k.startswith(start)}
        return found if detail else list(found)

    def info(self, path):
        return self.mem.info(path)

    def pipe_file(self, path, data):
        self.mem.pipe_file(path, data)

    def rm_file(self, path):
        if self.fail_rm is not None:
            raise self.fail_rm
        self.mem.rm_file(path)

    def cat_ranges(self, paths, starts, ends):
        return [self.mem.cat_file(p, s, e) for p, s, e in zip(paths, starts, ends, strict=True)]

    def open(self, key, mode, block_size=None):
        self.opened_modes.append(mode)
        return FakeUpload(self, key, mode, block_size)

    def call_s3(self, method, **kwargs):
        if method == "list_multipart_uploads":
            self.on_list_uploads()
            mine = [
                {"Key": key.split("/", 2)[2], "UploadId": uid, "Initiated": time.time()}
                for uid, key in self.uploads.items()
            ]
            return {"Uploads": mine + self.listed_uploads}
        if method == "abort_multipart_upload":
            self.uploads.pop(kwargs["UploadId"], None)
            self.listed_uploads = [
                u for u in self.listed_uploads if u["UploadId"] != kwargs["UploadId"]
            ]
            return {}
        raise AssertionError(method)


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(_fsspec, "_PART_BYTES", 1000)
    fs = FakeS3()
    return fs, _fsspec.FsspecStorage("s3", fs)


def _marker(name, host, pid):
    return f"/b/run/.{name}{_names.TEMP_MARK}{host}-{pid}-{'a' * 16}"


def _upload(name, upload_id, age_s=0.0):
    return {"Key": f"run/{name}", "UploadId": upload_id, "Initiated": time.time() - age_s}


def _live_pid():
    return os.getppid()  # the test runner's parent: alive, and not this process


def test_cleanup_sees_a_writer_that_starts_between_its_two_listings(fake):
    """Uploads are listed before markers, and a writer puts its marker before it starts
    its upload: a live writer that starts meanwhile is never mistaken for the dead one."""
    fs, store = fake
    name = "checkpoint_2000.safetensors"
    fs.mem.pipe_file(_marker(name, _names.host_id(), 999_999_999 % 2**22), b"")  # killed
    assert _names.writer_is_dead(_names.host_id(), 999_999_999 % 2**22)
    fs.listed_uploads = [_upload(name, "killed", age_s=60)]

    def live_writer_starts():
        fs.mem.pipe_file(_marker(name, _names.host_id(), _live_pid()), b"")
        fs.listed_uploads.append(_upload(name, "live"))

    fs.on_list_uploads = live_writer_starts
    _directory.remove_leftovers(store, "s3://b/run", "checkpoint_")
    assert [u["UploadId"] for u in fs.listed_uploads] == ["killed", "live"]  # both kept
    fs.on_list_uploads = lambda: None
    # Once the live writer is gone too, the next cleanup aborts both and drops the markers.
    fs.mem.rm_file(_marker(name, _names.host_id(), _live_pid()))
    _directory.remove_leftovers(store, "s3://b/run", "checkpoint_")
    assert fs.listed_uploads == [] and fs.mem.find("/b/run") == []


def test_a_live_writer_on_this_host_is_never_stale_however_long_it_uploads(fake, monkeypatch):
    fs, store = fake
    here, elsewhere = "checkpoint_1.safetensors", "checkpoint_2.safetensors"
    fs.mem.pipe_file(_marker(here, _names.host_id(), _live_pid()), b"")
    fs.mem.pipe_file(_marker(elsewhere, "ffffffff", 12345), b"")
    fs.listed_uploads = [_upload(here, "here"), _upload(elsewhere, "elsewhere")]
    later = time.time() + _directory.STALE_S + 60  # both have been uploading for 61 minutes
    monkeypatch.setattr(_directory, "time", types.SimpleNamespace(time=lambda: later))
    _directory.remove_leftovers(store, "s3://b/run", "checkpoint_")
    assert [u["UploadId"] for u in fs.listed_uploads] == ["here"]
    assert fs.mem.find("/b/run") == [_marker(here, _names.host_id(), _live_pid())]


def test_the_marker_of_a_long_upload_is_refreshed_before_every_part(fake):
    fs, store = fake
    seen = []
    real_pipe = fs.pipe_file

    def pipe(path, data):
        seen.append(path)
        real_pipe(path, data)

    fs.pipe_file = pipe

    def write(out):
        for _ in range(7):
            out.write(b"x" * 500)

    store.atomic_write("s3://b/run/checkpoint_1.safetensors", write)
    assert len(seen) == 3 and len(set(seen)) == 1  # one marker, written at 1000, 2000, 3000
    assert fs.mem.find("/b/run") == ["/b/run/checkpoint_1.safetensors"]  # and removed


def test_a_failed_marker_removal_never_fails_a_committed_upload_or_hides_an_error(fake):
    fs, store = fake
    fs.fail_rm = botocore.exceptions.EndpointConnectionError(endpoint_url="http://s3")
    store.atomic_write("s3://b/run/checkpoint_1.safetensors", lambda out: out.write(b"x" * 1500))
    assert fs.mem.cat_file("/b/run/checkpoint_1.safetensors") == b"x" * 1500

    def fails_midway(out):
        out.write(b"x" * 1500)
        raise ValueError("the writer's own error")

    with pytest.raises(ValueError, match="the writer's own error"):
        store.atomic_write("s3://b/run/checkpoint_2.safetensors", fails_midway)
    assert fs.uploads == {}  # its upload was aborted


def test_a_refused_conditional_completion_is_a_concurrent_save_and_aborts_the_upload(fake):
    fs, store = fake
    real_exists = store.exists
    calls = []

    def exists(path):  # the other writer commits right after our last check
        calls.append(path)
        if len(calls) == 2:
            fs.mem.pipe_file("/b/run/checkpoint_1.safetensors", b"theirs")
        return real_exists(path)

    store.exists = exists
    with pytest.raises(FileExistsError, match="checkpoint_1"):
        store.atomic_write(
            "s3://b/run/checkpoint_1.safetensors", lambda out: out.write(b"x" * 1500), replace=False
        )
    assert fs.opened_modes == ["xb"] and fs.uploads == {}
    assert fs.mem.cat_file("/b/run/checkpoint_1.safetensors") == b"theirs"


def test_a_store_without_conditional_writes_falls_back_to_the_check(fake):
    fs, store = fake
    fs.refuse_conditions = True
    for step in (1, 2):
        store.atomic_write(
            f"s3://b/run/checkpoint_{step}.safetensors",
            lambda out: out.write(b"x" * 10),
            replace=False,
        )
    assert fs.opened_modes == ["xb", "wb", "wb"]  # asked once, then never again
    assert fs.mem.find("/b/run") == [f"/b/run/checkpoint_{s}.safetensors" for s in (1, 2)]


def test_an_unreachable_store_during_retention_never_deletes_the_best_checkpoint():
    url = "memory://eqx-test-blip/run"
    manager = checkpoints.CheckpointManager(
        url, keep_latest=1, keep_best=1, best_metric="loss", handle_sigterm=False
    )
    manager.save(1, {"x": np.zeros(2)}, metrics={"loss": 0.1})  # the best
    manager.save(2, {"x": np.zeros(2)}, metrics={"loss": 0.9})
    # A new manager (the job restarted) has read no metric yet: its retention must read
    # checkpoint 1's (one that read it before would use what it read).
    manager = checkpoints.CheckpointManager(
        url, keep_latest=1, keep_best=1, best_metric="loss", handle_sigterm=False
    )
    fs = cast(Any, manager._store).fs  # the fsspec-backed storage's filesystem
    real_info = fs.info

    def blip(path, **kwargs):
        if "checkpoint_1." in path:
            raise botocore.exceptions.EndpointConnectionError(endpoint_url="http://s3")
        return real_info(path, **kwargs)

    fs.info = blip
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # not "unreadable, counts as having no metric"
            with pytest.raises(OSError, match="checkpoint_1.*EndpointConnectionError"):
                manager.save(3, {"x": np.zeros(2)}, metrics={"loss": 0.5})
    finally:
        fs.info = real_info
    assert checkpoints.available_steps(url) == [1, 2, 3]
    fs.rm("/eqx-test-blip", recursive=True)


def test_a_listed_local_checkpoint_removed_before_it_is_opened_is_as_if_never_there(
    tmp_path, monkeypatch
):
    """Unchanged local behaviour: retention elsewhere removed the only checkpoint after it
    was listed, so the directory holds none and the target comes back."""
    path = checkpoints.save_checkpoint(tmp_path, {"x": np.ones(2)}, 1)
    real = _restore.open_reader

    def removed_first(store, where):
        if os.path.exists(where.path):
            os.remove(where.path)
        return real(store, where)

    monkeypatch.setattr(_restore, "open_reader", removed_first)
    target = {"x": np.zeros(2)}
    assert checkpoints.restore_checkpoint(tmp_path, target) is target
    checkpoints.save_checkpoint(tmp_path, {"x": np.ones(2)}, 1)
    with pytest.raises(FileNotFoundError, match="checkpoint_1"):
        checkpoints.restore_checkpoint(path, target)  # named, and gone: not "nothing there"


def test_a_checkpoint_whose_index_cannot_be_removed_keeps_its_pieces(monkeypatch):
    """Retention uncommits a `.shards` checkpoint by removing its index first; if that
    removal fails (best effort, as every removal), the pieces it cites stay, so the still
    listed checkpoint still restores whole."""
    url = "memory://eqx-test-stuck-index/run"
    old = {"x": np.arange(4.0)}
    checkpoints.save_checkpoint_multiprocess(url, old, 1)
    real_remove = _fsspec.FsspecStorage.remove

    def index_stuck(self, path):
        if not path.endswith(_names.INDEX_NAME):
            real_remove(self, path)

    monkeypatch.setattr(_fsspec.FsspecStorage, "remove", index_stuck)
    checkpoints.save_checkpoint_multiprocess(url, {"x": np.ones(4)}, 2, keep=1)
    monkeypatch.undo()
    assert checkpoints.available_steps(url) == [1, 2]
    restored = checkpoints.restore_checkpoint(url, {"x": np.zeros(4)}, step=1)
    np.testing.assert_array_equal(restored["x"], old["x"])
    MemoryFileSystem().rm("/eqx-test-stuck-index", recursive=True)
