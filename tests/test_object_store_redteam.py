"""A second, adversarial pass over the object-store promises of issue 22 (lost answers,
deadlines, URLs the store rewrites, refused access), on the real S3 server (SeaweedFS on
127.0.0.1) behind `tests.fault_proxy.FaultProxy`: what a commit whose answer never comes
back leaves, and which URL spellings name one location and which name two."""

import re
import time
import unicodedata

import numpy as np
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints import _locations, _object_storage
from tests.fault_proxy import FaultProxy
from tests.helpers import assert_trees_equal

INDEX = "index.safetensors"


@pytest.fixture
def proxied(s3_server, s3_bucket):
    """(URL of a fresh run, storage_options through a fault proxy, the proxy)."""
    with FaultProxy(s3_server.endpoint_url, max_stall_s=30) as proxy:
        options = {
            **s3_server.storage_options,
            "client_kwargs": {"endpoint_url": proxy.url, "region_name": "us-east-1"},
        }
        yield f"{s3_bucket}/run", options, proxy


@pytest.fixture
def impatient(proxied, monkeypatch):
    """`proxied`, with a client that does not retry (a dropped answer fails at once)."""
    s3fs = pytest.importorskip("s3fs")
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    url, options, proxy = proxied
    return url, {**options, "config_kwargs": {"retries": {"max_attempts": 1}}}, proxy


def _store(url, options):
    return _locations.resolve(url, options, caller="test")[0]


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
    real = _object_storage.ObjectStorage._is_ours

    def is_ours(self, *args):
        asking.append(True)
        try:
            return real(self, *args)
        finally:
            asking.clear()

    monkeypatch.setattr(_object_storage.ObjectStorage, "_is_ours", is_ours)
    rule = proxy.drop_response(
        _after_first("PUT", "checkpoint_1.safetensors", lambda r: bool(asking)), times=10**6
    )
    with pytest.raises(OSError, match=re.escape(url)) as raised:
        checkpoints.save_checkpoint(url, tree, 1, storage_options=options)
    assert "concurrent" not in str(raised.value)
    assert [r.method for r in rule.hits][:2] == ["PUT", "HEAD"]  # the fault landed
    assert checkpoints.available_steps(url, storage_options=options) == [1]
    assert_trees_equal(checkpoints.restore_checkpoint(url, tree, storage_options=options), tree)
