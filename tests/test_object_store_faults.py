"""Saves to an object store whose network misbehaves: answers lost after the store did the
work (the client retries by itself), a store that stops answering, refused credentials, and
URLs the store would rewrite. The store is the real S3 server (SeaweedFS on 127.0.0.1)
behind `tests.support.fault_proxy.FaultProxy`, or the server itself frozen with SIGSTOP."""

import contextlib
import os
import re
import signal
import time
from typing import Any

import numpy as np
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints.format import _format
from eqx_train.checkpoints.storage import _fsspec, _locations
from tests.support.helpers import assert_trees_equal


def _store(url, options) -> Any:
    """The fsspec-backed storage of `url`: the tests reach into its `fs`."""
    return _locations.resolve(url, options)[0]


def _leftovers(store, url):
    """Everything in the run besides committed checkpoints: unfinished uploads, markers."""
    bucket, _, prefix = store.strip(url).partition("/")
    uploads = store.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix + "/")
    names = [i.name for i in store.list(url) if not i.name.startswith("checkpoint_")]
    return [u["Key"] for u in uploads.get("Uploads") or []] + names


# ---------------------------------------------------------------- lost answers (defect 1)


def test_a_lost_answer_to_the_shards_index_upload_keeps_the_committed_checkpoint(proxied):
    url, options, proxy = proxied
    old, new = {"x": np.arange(4.0)}, {"x": np.arange(4.0) + 10}
    checkpoints.save_checkpoint_multiprocess(url, old, 1, storage_options=options)
    index = "checkpoint_2.shards/index.safetensors"
    drop = proxy.drop_response(lambda r: r.method == "PUT" and r.path.endswith(index))
    checkpoints.save_checkpoint_multiprocess(url, new, 2, keep=1, storage_options=options)
    # Proof the fault landed: the index PUT reached the store, its answer was dropped, and
    # the client sent it again (refused: the index existed by then).
    puts = [r for r in proxy.log if r.method == "PUT" and r.path.endswith(index)]
    assert len(drop.hits) == 1 and len(puts) == 2, [(r.method, r.path, r.fate) for r in proxy.log]
    assert checkpoints.available_steps(url, storage_options=options) == [2]
    assert_trees_equal(checkpoints.restore_checkpoint(url, new, storage_options=options), new)


def test_a_lost_answer_to_a_single_file_upload_is_not_a_concurrent_save(proxied):
    url, options, proxy = proxied
    tree = {"x": np.arange(6.0)}
    drop = proxy.drop_response(lambda r: r.method == "PUT" and r.path.endswith(".safetensors"))
    path = checkpoints.save_checkpoint(url, tree, 1, storage_options=options)
    assert len(drop.hits) == 1
    assert [r.fate for r in proxy.log if r.method == "PUT"] == ["drop_response", "forwarded"]
    assert checkpoints.latest_checkpoint(url, storage_options=options) == path
    assert_trees_equal(checkpoints.restore_checkpoint(url, tree, storage_options=options), tree)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_lost_answer_to_a_multipart_completion_is_recognised_as_our_write(
    proxied, monkeypatch, overwrite
):
    url, options, proxy = proxied
    monkeypatch.setattr(_fsspec, "_PART_BYTES", 5 << 20)  # S3's smallest part
    old, new = {"x": np.zeros(4)}, {"x": np.full(3 << 20, 7.0)}  # 24 MiB: five parts
    checkpoints.save_checkpoint(url, old, 1, storage_options=options)
    step = 1 if overwrite else 2
    drop = proxy.drop_response(lambda r: r.method == "POST" and "uploadId=" in r.query)
    checkpoints.save_checkpoint(url, new, step, overwrite=overwrite, storage_options=options)
    assert len(drop.hits) == 1  # the completion was committed, and its answer lost
    assert checkpoints.available_steps(url, storage_options=options) == [step]  # keep=1
    assert_trees_equal(checkpoints.restore_checkpoint(url, new, storage_options=options), new)
    assert _leftovers(_store(url, options), url) == []


def test_an_index_refused_as_existing_that_cites_this_saves_pieces_is_our_commit(monkeypatch):
    """Where the store cannot prove an upload ours (no token in its metadata), the `.shards`
    commit still recognises its own index by the pieces it cites, and deletes nothing."""
    url = "memory://eqx-test-lost-index/run"
    real = _fsspec.FsspecStorage.atomic_write

    def committed_then_refused(self, path, write, *, replace=True):
        real(self, path, write, replace=replace)
        if path.endswith("index.safetensors"):
            raise FileExistsError(path)  # a retry, refused: the answer to ours was lost

    monkeypatch.setattr(_fsspec.FsspecStorage, "atomic_write", committed_then_refused)
    tree = {"x": np.arange(5.0)}
    checkpoints.save_checkpoint_multiprocess(url, {"x": np.zeros(5)}, 1)
    checkpoints.save_checkpoint_multiprocess(url, tree, 2, keep=1)
    monkeypatch.undo()
    assert checkpoints.available_steps(url) == [2]
    assert_trees_equal(checkpoints.restore_checkpoint(url, tree), tree)
    _store(url, None).fs.rm("/eqx-test-lost-index", recursive=True)


def test_an_index_of_a_concurrent_save_is_still_refused(monkeypatch):
    url = "memory://eqx-test-other-index/run"
    theirs = {"x": np.full(3, 9.0)}
    real = _fsspec.FsspecStorage.atomic_write

    def other_save_first(self, path, write, *, replace=True):
        if path.endswith("index.safetensors") and not replace:
            monkeypatch.setattr(_fsspec.FsspecStorage, "atomic_write", real)
            checkpoints.save_checkpoint_multiprocess(url, theirs, 1, overwrite=True)
        real(self, path, write, replace=replace)

    monkeypatch.setattr(_fsspec.FsspecStorage, "atomic_write", other_save_first)
    with pytest.raises(FileExistsError):
        checkpoints.save_checkpoint_multiprocess(url, {"x": np.zeros(3)}, 1)
    assert_trees_equal(checkpoints.restore_checkpoint(url, theirs), theirs)
    _store(url, None).fs.rm("/eqx-test-other-index", recursive=True)


# ---------------------------------------------------------------- rewritten URLs (defect 4)


@pytest.mark.parametrize(
    "suffix",
    ["a//run", "a\\run", "a/./run", "a/../run", "./run", "run/.", "a./run", "run.", "a\nrun"],
)
def test_urls_the_store_would_rewrite_are_refused_naming_the_url(s3_server, s3_bucket, suffix):
    url, options = f"{s3_bucket}/{suffix}", s3_server.storage_options
    with pytest.raises(ValueError, match=re.escape(repr(url))):
        checkpoints.save_checkpoint(url, {"x": np.zeros(2)}, 1, storage_options=options)
    with pytest.raises(ValueError, match="object stores rewrite"):
        checkpoints.CheckpointManager(url, storage_options=options)
    with pytest.raises(ValueError, match="object stores rewrite"):
        checkpoints.restore_checkpoint(url, None, storage_options=options)
    bucket = s3_bucket.split("://")[1]
    assert _store(s3_bucket, options).fs.find(bucket) == []  # nothing was written


def test_a_url_with_leading_slashes_after_the_bucket_is_refused():
    with pytest.raises(ValueError, match=re.escape("'s3://bkt//run'")):
        checkpoints.save_checkpoint("s3://bkt//run", {"x": np.zeros(2)}, 1)
    with pytest.raises(ValueError, match="empty path segment"):
        checkpoints.latest_checkpoint("memory://a//b")


# ------------------------------------------------------------- a frozen store (defect 5)


def test_a_store_that_stops_answering_fails_the_save_at_its_deadline_naming_the_url(proxied):
    url, options, proxy = proxied
    old = {"x": np.arange(3.0)}
    checkpoints.save_checkpoint(url, old, 1, storage_options=options)
    proxy.stall()  # from now on every request is accepted and never answered
    # Only the save's own deadline can end this: the client's read timeout is 60 s.
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=re.escape(url) + ".*deadline of 2 s"):
        checkpoints.save_checkpoint(
            url, {"x": np.ones(3)}, 2, storage_options={**options, "deadline_s": 2}
        )
    assert 2 <= time.monotonic() - started < 8
    assert any(r.fate == "stall" for r in proxy.log)
    proxy.release()
    assert checkpoints.available_steps(url, storage_options=options) == [1]
    assert_trees_equal(checkpoints.restore_checkpoint(url, old, storage_options=options), old)


def test_an_upload_frozen_before_its_completion_is_aborted_by_the_next_save(proxied, monkeypatch):
    url, options, proxy = proxied
    monkeypatch.setattr(_fsspec, "_PART_BYTES", 5 << 20)
    checkpoints.save_checkpoint(url, {"x": np.zeros(2)}, 1, storage_options=options)
    # Parts go through; the completion, and everything after it, never gets an answer.
    completion = proxy.stall(lambda r: r.method == "POST" and "uploadId=" in r.query)
    with pytest.raises(TimeoutError, match=re.escape(url)):
        checkpoints.save_checkpoint(
            url, {"x": np.ones(2 << 20)}, 2, storage_options={**options, "deadline_s": 3}
        )
    assert len(completion.hits) == 1  # the freeze landed mid-upload, parts sent
    proxy.release()
    store = _store(url, options)
    assert len(_leftovers(store, url)) == 2  # its unfinished upload, and its writer's marker
    assert checkpoints.available_steps(url, storage_options=options) == [1]
    checkpoints.save_checkpoint(url, {"x": np.full(2, 3.0)}, 3, storage_options=options)
    assert _leftovers(store, url) == []
    assert checkpoints.available_steps(url, storage_options=options) == [3]


@contextlib.contextmanager
def _frozen(server):
    os.killpg(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(server.process.pid, signal.SIGCONT)


def test_a_server_frozen_mid_save_keeps_the_previous_checkpoint(s3_server, s3_bucket, monkeypatch):
    url, options = f"{s3_bucket}/run", s3_server.storage_options
    old, new = {"x": np.arange(3.0)}, {"x": np.arange(3.0) + 1}
    checkpoints.save_checkpoint(url, old, 1, storage_options=options)
    real_write = _format.write_file
    frozen = contextlib.ExitStack()

    def freeze_then_write(out, *args, **kwargs):
        frozen.enter_context(_frozen(s3_server))  # SIGSTOP, from inside the save's write
        return real_write(out, *args, **kwargs)

    monkeypatch.setattr(_format, "write_file", freeze_then_write)
    started = time.monotonic()
    with frozen, pytest.raises(TimeoutError, match=re.escape(url)):
        checkpoints.save_checkpoint(url, new, 2, storage_options={**options, "deadline_s": 3})
    assert time.monotonic() - started < 10
    monkeypatch.setattr(_format, "write_file", real_write)
    # The server, resumed, may still carry out the upload it had received: then step 2 is
    # whole. Either way step 1 is intact and the next save works.
    steps = checkpoints.available_steps(url, storage_options=options)
    assert steps in ([1], [1, 2]), steps
    assert_trees_equal(
        checkpoints.restore_checkpoint(url, old, step=1, storage_options=options), old
    )
    checkpoints.save_checkpoint(url, new, 3, keep=5, storage_options=options)
    assert_trees_equal(checkpoints.restore_checkpoint(url, new, storage_options=options), new)


def test_a_restore_from_a_store_that_stops_answering_fails_at_the_deadline(proxied):
    url, options = proxied[:2]
    checkpoints.save_checkpoint(url, {"x": np.zeros(3)}, 1, storage_options=options)
    proxied[2].stall()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=re.escape(url) + ".*deadline of 1 s"):
        checkpoints.restore_checkpoint(url, None, storage_options={**options, "deadline_s": 1})
    assert time.monotonic() - started < 6


def test_s3_requests_get_bounded_timeouts_and_retries_unless_the_caller_sets_them():
    pytest.importorskip("s3fs")
    store = _store("s3://bkt/run", {"anon": True})
    assert store.fs.config_kwargs == {
        "connect_timeout": 10,
        "read_timeout": 60,
        "retries": {"max_attempts": 3, "mode": "standard"},
    }
    assert store.deadline_s == _fsspec.DEFAULT_DEADLINE_S
    mine = {"anon": True, "config_kwargs": {"read_timeout": 5}, "deadline_s": 30}
    store = _store("s3://bkt/run", mine)
    assert store.fs.config_kwargs["read_timeout"] == 5 and store.deadline_s == 30
    assert mine["deadline_s"] == 30  # the caller's dict is left as it was


def test_deadline_s_must_be_a_positive_number():
    for bad in (0, -1, float("inf"), "10", True):
        with pytest.raises(ValueError, match=r"deadline_s.*positive"):
            checkpoints.latest_checkpoint("memory://run", storage_options={"deadline_s": bad})


# ------------------------------------------------------------- refused access (defect 9)


def test_a_permission_error_names_the_url(s3_server, s3_bucket):
    url = f"{s3_bucket}/run"
    options = {**s3_server.storage_options, "secret": "not-the-secret"}
    with pytest.raises(PermissionError, match=re.escape(url)):
        checkpoints.save_checkpoint(url, {"x": np.zeros(2)}, 1, storage_options=options)
    with pytest.raises(PermissionError, match=re.escape(url)):
        checkpoints.restore_checkpoint(url, None, storage_options=options)
