"""A second, adversarial pass over the object-store promises of issue 22 (lost answers,
deadlines, URLs the store rewrites, refused access), on the real S3 server (SeaweedFS on
127.0.0.1) behind `tests.support.fault_proxy.FaultProxy`: what a commit whose answer never comes
back leaves, and which URL spellings name one location and which name two."""

import re
import time
import unicodedata
from typing import Any

import numpy as np
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints.storage import _fsspec, _locations
from tests.support.helpers import assert_trees_equal

INDEX = "index.safetensors"


@pytest.fixture
def impatient(proxied, monkeypatch):
    """`proxied`, with a client that does not retry (a dropped answer fails at once)."""
    s3fs = pytest.importorskip("s3fs")
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    url, options, proxy = proxied
    return url, {**options, "config_kwargs": {"retries": {"max_attempts": 1}}}, proxy


def _store(url, options) -> Any:
    """The fsspec-backed storage of `url`: the tests reach into its `fs`."""
    return _locations.resolve(url, options)[0]


def _keys(store, bucket_url):
    bucket = store.strip(bucket_url)
    return sorted(k[len(bucket) + 1 :] for k in store.fs.find(bucket))


# ------------------------------------------------- a commit whose answer never comes back


def test_an_index_committed_whose_answers_are_all_lost_keeps_the_pieces_it_cites(impatient):
    """The index upload reaches the store; then every answer about the index is lost (the
    PUT, its retries, the HEADs that would tell whose it is). The save cannot know whether
    it committed, so it must not delete the pieces: the index is there and cites them."""
    url, options, proxy = impatient
    old, new = {"x": np.arange(4.0)}, {"x": np.arange(4.0) + 10}
    checkpoints.save_checkpoint_multiprocess(url, old, 1, storage_options=options)
    index = f"checkpoint_2.shards/{INDEX}"
    put = []

    def after_the_commit(r):  # the index PUT, and every later request about the index
        put.extend([r] if r.method == "PUT" and r.path.endswith(index) else [])
        return bool(put) and r.method != "DELETE" and r.path.endswith(index)

    lost = proxy.drop_response(after_the_commit, times=10**6)
    with pytest.raises(OSError, match=re.escape(url)):
        checkpoints.save_checkpoint_multiprocess(
            url, new, 2, keep=1, storage_options={**options, "deadline_s": 300}
        )
    puts = [r for r in lost.hits if r.method == "PUT"]
    assert puts and puts[0].fate == "drop_response"  # the commit reached the store
    lost.times = 0  # the network is back
    assert checkpoints.available_steps(url, storage_options=options) == [1, 2]
    assert_trees_equal(checkpoints.restore_checkpoint(url, new, storage_options=options), new)
    assert_trees_equal(
        checkpoints.restore_checkpoint(url, old, step=1, storage_options=options), old
    )


def _after_first(method, suffix, then):
    """A proxy rule: once a `method` request for a path ending in `suffix` has been seen
    (it matches too), requests for that path that `then(request)` accepts."""
    seen = []

    def matches(r):
        if not seen and r.method == method and r.path.endswith(suffix):
            seen.append(r)
            return True
        return bool(seen) and r.path.endswith(suffix) and then(r)

    return matches


def test_a_lost_answer_whose_owner_cannot_be_read_is_not_called_a_concurrent_save(
    impatient, monkeypatch
):
    """The upload is committed and its answer lost; the client's retry is refused (the object
    exists), and the question "whose is it" gets no answer either (every answer to it is
    lost; the store answers again just after). That is not proof of a concurrent save: the
    save reports the network error naming the URL, and the checkpoint is whole."""
    url, options, proxy = impatient
    tree = {"x": np.arange(6.0)}
    asking = []
    real = _fsspec.FsspecStorage._is_ours

    def is_ours(self, *args):
        asking.append(True)
        try:
            return real(self, *args)
        finally:
            asking.clear()

    monkeypatch.setattr(_fsspec.FsspecStorage, "_is_ours", is_ours)
    rule = proxy.drop_response(
        _after_first("PUT", "checkpoint_1.safetensors", lambda r: bool(asking)), times=10**6
    )
    with pytest.raises(OSError, match=re.escape(url)) as raised:
        checkpoints.save_checkpoint(url, tree, 1, storage_options=options)
    assert "concurrent" not in str(raised.value)
    assert [r.method for r in rule.hits][:2] == ["PUT", "HEAD"]  # the fault landed
    assert checkpoints.available_steps(url, storage_options=options) == [1]
    assert_trees_equal(checkpoints.restore_checkpoint(url, tree, storage_options=options), tree)


def test_a_peer_keeps_its_pieces_when_process_0_cannot_tell_whether_it_committed(monkeypatch):
    """Process 1's side of the commit above: process 0 answers that its index write got no
    answer, so process 1 must keep its piece too (an index citing it may be committed);
    after a definite failure it takes its piece back."""
    import jax

    from eqx_train.checkpoints.pipeline import _coordination, _multiprocess
    from eqx_train.checkpoints.storage import Storage

    url = "memory://eqx-test-unsure-peer/run/checkpoint_1.shards"
    store = _locations.resolve(url, None)[0]
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(_coordination, "gather", lambda op, value, **kw: ["ok", value])
    token = "0bbfd16a-1-0123456789abcdef"
    piece = store.join(url, f"process_00001.{token}.safetensors")
    for answer, kept in [
        (_multiprocess._UNSURE + f"OSError: {url}/index.safetensors: connection reset", True),
        ("ValueError: the processes disagree", False),
    ]:
        monkeypatch.setattr(_coordination, "broadcast", lambda op, value, a=answer, **kw: a)
        with pytest.raises(RuntimeError, match="did not commit"):
            _multiprocess.write_and_commit(
                store, url, token, "save-1-step-1", ([], {}), [], {}, timeout_s=5,
                overwrite=False, after_commit=lambda: None,
            )  # fmt: skip
        assert isinstance(store, Storage) and store.exists(piece) == kept


# ------------------------------------------------------ other lost answers (held already)


def test_a_lost_answer_to_a_delete_during_retention_removes_the_old_checkpoint_whole(impatient):
    url, options, proxy = impatient
    old, new = {"x": np.arange(3.0)}, {"x": np.arange(3.0) + 5}
    checkpoints.save_checkpoint_multiprocess(url, old, 1, storage_options=options)
    lost = proxy.drop_response(lambda r: r.method == "DELETE" and r.path.endswith(INDEX))
    checkpoints.save_checkpoint_multiprocess(url, new, 2, keep=1, storage_options=options)
    assert len(lost.hits) == 1  # the old index was deleted; the answer never came
    assert checkpoints.available_steps(url, storage_options=options) == [2]
    assert_trees_equal(checkpoints.restore_checkpoint(url, new, storage_options=options), new)
    store = _store(url, options)
    left = [k.rsplit("/run/", 1)[1] for k in store.fs.find(store.strip(url))]
    assert [k.split("/")[0] for k in left] == ["checkpoint_2.shards"] * 2, left  # index, piece


def test_a_lost_answer_to_an_overwrite_of_a_single_file_keeps_the_new_checkpoint(impatient):
    url, options, proxy = impatient
    old, new = {"x": np.zeros(3)}, {"x": np.ones(3)}
    checkpoints.save_checkpoint(url, old, 1, storage_options=options)
    lost = proxy.drop_response(lambda r: r.method == "PUT" and r.path.endswith(".safetensors"))
    checkpoints.save_checkpoint(url, new, 1, overwrite=True, storage_options=options)
    assert len(lost.hits) == 1
    assert checkpoints.available_steps(url, storage_options=options) == [1]
    assert_trees_equal(checkpoints.restore_checkpoint(url, new, storage_options=options), new)


def test_a_lost_answer_to_the_upload_marker_write_does_not_fail_the_save(proxied, monkeypatch):
    url, options, proxy = proxied
    monkeypatch.setattr(_fsspec, "_PART_BYTES", 5 << 20)
    tree = {"x": np.full(3 << 20, 2.0)}  # 24 MiB: a multipart upload, with its marker
    lost = proxy.drop_response(lambda r: r.method == "PUT" and ".tmp-" in r.path)
    checkpoints.save_checkpoint(url, tree, 1, storage_options=options)
    assert len(lost.hits) == 1
    assert_trees_equal(checkpoints.restore_checkpoint(url, tree, storage_options=options), tree)
    store = _store(url, options)
    assert [i.name for i in store.list(url)] == ["checkpoint_1.safetensors"]  # marker gone


# ------------------------------------------------------------------------------ deadlines


@pytest.mark.parametrize("multiprocess", [False, True])
def test_the_deadline_is_one_budget_for_a_slow_but_steady_store(proxied, multiprocess):
    """Every request is answered, 0.3 s late: no request alone is near any timeout, but the
    save needs more requests than 2 s allow. The budget covers them all together."""
    url, options, proxy = proxied
    save = checkpoints.save_checkpoint_multiprocess if multiprocess else checkpoints.save_checkpoint
    old = {"x": np.arange(3.0)}
    save(url, old, 1, storage_options=options)
    slow = proxy.slow(0.3)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=re.escape(url) + ".*deadline of 2 s"):
        save(url, {"x": np.ones(3)}, 2, storage_options={**options, "deadline_s": 2})
    assert 2 <= time.monotonic() - started < 5
    assert len(slow.hits) >= 4  # answered requests, each well within every timeout
    slow.times = 0
    assert checkpoints.available_steps(url, storage_options=options) in ([1], [1, 2])
    assert_trees_equal(
        checkpoints.restore_checkpoint(url, old, step=1, storage_options=options), old
    )


@pytest.mark.parametrize(
    "bad", [0, -1.5, float("nan"), float("inf"), -float("inf"), "60", True, False, None, [60]]
)
def test_a_deadline_that_is_not_a_positive_number_of_seconds_is_refused(bad):
    for call in (
        lambda o: checkpoints.save_checkpoint("memory://eqx-dl/run", {"x": np.ones(2)}, 1,
                                              storage_options=o),
        lambda o: checkpoints.CheckpointManager("memory://eqx-dl/run", storage_options=o),
        lambda o: checkpoints.available_steps("s3://bkt/run", storage_options=o),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(repr(bad)) + ".*deadline_s|deadline_s"):
            call({"deadline_s": bad})


@pytest.mark.parametrize("good", [np.float32(2.5), np.int64(3), 10**6, 1e9])
def test_a_deadline_of_any_real_number_type_is_taken(good):
    url = "memory://eqx-dl-good/run"
    checkpoints.save_checkpoint(url, {"x": np.ones(2)}, 1, storage_options={"deadline_s": good})
    assert checkpoints.available_steps(url, storage_options={"deadline_s": good}) == [1]
    _store(url, None).fs.rm("/eqx-dl-good", recursive=True)


def test_a_deadline_that_runs_out_during_retention_deletes_nothing_half(proxied):
    """The new checkpoint is committed; then the store freezes while retention removes the
    old one. The save fails at its deadline naming the URL; both checkpoints stay whole."""
    url, options, proxy = proxied
    old, new = {"x": np.arange(3.0)}, {"x": np.arange(3.0) + 1}
    checkpoints.save_checkpoint_multiprocess(url, old, 1, storage_options=options)
    committed = []

    def after_the_commit(r):
        if r.method == "PUT" and r.path.endswith(f"checkpoint_2.shards/{INDEX}"):
            committed.append(r)
            return False
        return bool(committed)

    frozen = proxy.stall(after_the_commit)
    with pytest.raises(TimeoutError, match=re.escape(url) + ".*deadline of 3 s"):
        checkpoints.save_checkpoint_multiprocess(
            url, new, 2, keep=1, storage_options={**options, "deadline_s": 3}
        )
    assert committed and frozen.hits  # the freeze came after the commit, during retention
    proxy.release()
    assert checkpoints.available_steps(url, storage_options=options) == [1, 2]
    assert_trees_equal(checkpoints.restore_checkpoint(url, new, storage_options=options), new)
    assert_trees_equal(
        checkpoints.restore_checkpoint(url, old, step=1, storage_options=options), old
    )
    checkpoints.save_checkpoint_multiprocess(url, new, 3, keep=1, storage_options=options)
    assert checkpoints.available_steps(url, storage_options=options) == [3]


def test_listing_a_store_that_stops_answering_fails_at_the_deadline_naming_the_url(proxied):
    url, options, proxy = proxied
    checkpoints.save_checkpoint(url, {"x": np.zeros(3)}, 1, storage_options=options)
    proxy.stall()
    quick = {**options, "deadline_s": 1}
    for call in (
        lambda: checkpoints.available_steps(url, storage_options=quick),
        lambda: checkpoints.latest_checkpoint(url, storage_options=quick),
        lambda: checkpoints.CheckpointManager(url, storage_options=quick),
    ):
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=re.escape(url) + ".*deadline of 1 s"):
            call()
        assert time.monotonic() - started < 6
    proxy.release()
    assert checkpoints.available_steps(url, storage_options=options) == [1]


# -------------------------------------------------------------------------------- URLs


def test_url_spellings_the_store_keeps_apart_are_distinct_locations(s3_server, s3_bucket):
    """Keys are byte strings: a percent sign, a space, or the two Unicode forms of one
    accented name (NFC, NFD) are kept as written by the store, so each spelling is its own
    run, found again by the same spelling, and never collides with a look-alike."""
    options = s3_server.storage_options
    nfc, nfd = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")
    names = ["a/run", "a%2Frun", "a run", "a%20run", nfc, nfd, "RUN", "run"]
    for step, name in enumerate(names, 1):
        checkpoints.save_checkpoint(
            f"{s3_bucket}/{name}", {"x": np.full(2, float(step))}, step, storage_options=options
        )
    for step, name in enumerate(names, 1):
        url = f"{s3_bucket}/{name}"
        assert checkpoints.available_steps(url, storage_options=options) == [step], name
        assert checkpoints.restore_checkpoint(url, None, storage_options=options)["x"][0] == step
    keys = _keys(_store(s3_bucket, options), s3_bucket)
    assert keys == sorted(f"{n}/checkpoint_{s}.safetensors" for s, n in enumerate(names, 1))


def test_url_spellings_of_one_location_find_the_same_checkpoints(s3_server, s3_bucket):
    options = s3_server.storage_options
    path = checkpoints.save_checkpoint(
        f"{s3_bucket}/run/", {"x": np.ones(2)}, 1, storage_options=options
    )
    assert path == f"{s3_bucket}/run/checkpoint_1.safetensors"
    bucket = s3_bucket.removeprefix("s3://")
    for same in (f"{s3_bucket}/run", f"{s3_bucket}/run//", f"S3://{bucket}/run/"):
        assert checkpoints.available_steps(same, storage_options=options) == [1]
    # The bucket's root is a location of its own (the run above is a "directory" there).
    checkpoints.save_checkpoint(s3_bucket, {"x": np.ones(2)}, 2, storage_options=options)
    assert checkpoints.available_steps(f"{s3_bucket}/", storage_options=options) == [2]
    assert checkpoints.available_steps(f"{s3_bucket}/run", storage_options=options) == [1]


def test_a_bucket_name_the_store_refuses_fails_naming_the_url(s3_server):
    url = "s3://Upper_Case/run"
    with pytest.raises(OSError, match=re.escape(url)):
        checkpoints.save_checkpoint(
            url, {"x": np.ones(2)}, 1, storage_options=s3_server.storage_options
        )


# ---------------------------------------------------------------------- refused access


def test_a_permission_error_while_listing_names_the_url(s3_server, s3_bucket):
    url, good = f"{s3_bucket}/run", s3_server.storage_options
    checkpoints.save_checkpoint(url, {"x": np.ones(2)}, 1, storage_options=good)
    options = {**good, "secret": "not-the-secret"}
    for call in (
        lambda: checkpoints.available_steps(url, storage_options=options),
        lambda: checkpoints.latest_checkpoint(url, storage_options=options),
        lambda: checkpoints.CheckpointManager(url, storage_options=options),
        lambda: checkpoints.save_checkpoint(url, {"x": np.ones(2)}, 2, storage_options=options),
    ):
        with pytest.raises(PermissionError, match=re.escape(url)):
            call()
    assert checkpoints.available_steps(url, storage_options=good) == [1]
