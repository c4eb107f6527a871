"""Checkpoints on object stores: every entry point takes a URL, and the promises of local
checkpoints hold there too (whole or nothing, listing only what is committed, retention,
byte-range restores). Each test runs on `memory://` and on a real S3 server (SeaweedFS on
127.0.0.1, started by the `s3_server` fixture)."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Any, cast

import equinox as eqx
import fsspec
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from eqx_train import TrainState, checkpoints
from eqx_train.checkpoints.format import _format, _names
from eqx_train.checkpoints.storage import _fsspec, _locations
from tests.support.helpers import assert_trees_equal


@pytest.fixture(params=["memory", "s3"])
def location(request, tmp_path):
    """(URL of a fresh checkpoint directory, storage_options) on each backend."""
    if request.param == "memory":
        url = f"memory://eqx-test-{os.getpid()}-{id(tmp_path)}/run"
        yield url, None
        fsspec.filesystem("memory").rm(url.split("://")[1].split("/")[0], recursive=True)
    else:
        server = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("s3_bucket")
        yield f"{bucket}/run", server.storage_options


def every_kind_of_leaf():
    model = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))
    dtypes = [
        np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
        np.uint64, np.float16, np.float32, np.float64, ml_dtypes.bfloat16,
        ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
    ]  # fmt: skip
    return {
        "arrays": {np.dtype(d).name: np.arange(6).reshape(2, 3).astype(d) for d in dtypes},
        "model": model,
        "key": jax.random.key(7),
        "scalars": (1, 2.5, True, np.float32(0.25)),
        "empty": ({}, [], ()),
        "jax": jnp.linspace(0, 1, 5),
        "text": "kept",
    }


def test_every_dtype_and_tree_kind_round_trips(location):
    url, options = location
    tree = every_kind_of_leaf()
    path = checkpoints.save_checkpoint(url, tree, 3, storage_options=options)
    assert path == f"{url}/checkpoint_3.safetensors"
    assert checkpoints.latest_checkpoint(url, storage_options=options) == path
    restored = checkpoints.restore_checkpoint(url, tree, storage_options=options)
    assert_trees_equal(restored, tree)
    as_saved = checkpoints.restore_checkpoint(path, None, storage_options=options)
    assert as_saved["arrays"]["bfloat16"].dtype == ml_dtypes.bfloat16
    assert as_saved["empty"] == ({}, [], ())


def test_retention_and_overwrite_follow_flax(location):
    url, options = location
    for step in range(5):
        checkpoints.save_checkpoint(
            url, {"x": np.full(3, step)}, step, keep=2, storage_options=options
        )
    assert checkpoints.available_steps(url, storage_options=options) == [3, 4]
    with pytest.raises(ValueError, match="not newer"):
        checkpoints.save_checkpoint(url, {"x": np.zeros(3)}, 3, storage_options=options)
    checkpoints.save_checkpoint(
        url, {"x": np.full(3, 30)}, 3.0, keep=2, overwrite=True, storage_options=options
    )
    assert checkpoints.available_steps(url, storage_options=options) == [3]
    restored = checkpoints.restore_checkpoint(url, None, storage_options=options)
    np.testing.assert_array_equal(restored["x"], np.full(3, 30))


def test_manager_and_async_saves(location):
    url, options = location
    manager = checkpoints.CheckpointManager(
        url, keep_latest=1, keep_best=1, best_metric="loss", async_save=True,
        storage_options=options,
    )  # fmt: skip
    state = TrainState.create(model={"w": jnp.ones(4)}, tx=optax.adam(1e-3))
    for step, loss in enumerate([3.0, 1.0, 2.0, 4.0]):
        manager.save(
            step, eqx.tree_at(lambda s: s.step, state, jnp.asarray(step)), metrics={"loss": loss}
        )
    manager.wait()
    assert checkpoints.available_steps(url, storage_options=options) == [1, 3]
    best = manager.restore(state, step=1)
    assert int(best.step) == 1
    assert int(manager.restore(state).step) == 3


def test_async_save_to_a_url_through_async_manager(location):
    url, options = location
    async_manager = checkpoints.AsyncManager()
    checkpoints.save_checkpoint(
        url, {"x": np.arange(4)}, 1, async_manager=async_manager, storage_options=options
    )
    future = async_manager.save_future
    assert future is not None  # the save just started
    future.result()
    assert checkpoints.available_steps(url, storage_options=options) == [1]


def test_shards_layout_commits_by_its_index(location):
    url, options = location
    tree = {"a": jnp.arange(16.0).reshape(4, 4), "b": np.ones(3, np.int8)}
    path = checkpoints.save_checkpoint_multiprocess(url, tree, 2, storage_options=options)
    assert path == f"{url}/checkpoint_2.shards"
    assert_trees_equal(checkpoints.restore_checkpoint(url, tree, storage_options=options), tree)
    # Pieces without an index are an uncommitted save: never listed, never restored.
    store, _ = _locations.resolve(url, options)
    store.atomic_write(
        f"{url}/checkpoint_9.shards/process_00000.00000000-1-0000000000000000.safetensors",
        lambda out: _format.write_file(out, [], {}),
    )
    assert checkpoints.available_steps(url, storage_options=options) == [2]
    assert_trees_equal(checkpoints.restore_checkpoint(url, None, storage_options=options), tree)


def test_restoring_one_leaf_reads_only_its_bytes(location, monkeypatch):
    url, options = location
    tree = {f"w{i}": np.full((256, 256), i, np.float32) for i in range(8)}
    checkpoints.save_checkpoint(url, tree, 1, storage_options=options)
    requested = []
    real = _fsspec.FsspecSource.read_ranges

    def counting(self, jobs):
        requested.extend(len(view) for view, _ in jobs)
        return real(self, jobs)

    monkeypatch.setattr(_fsspec.FsspecSource, "read_ranges", counting)
    with pytest.warns(checkpoints.PartialRestoreWarning, match="saved tensors went unused"):
        out = checkpoints.restore_checkpoint(
            url, {"w5": np.zeros((256, 256), np.float32)}, strict=False, storage_options=options
        )
    np.testing.assert_array_equal(out["w5"], tree["w5"])
    leaf = 256 * 256 * 4
    assert leaf <= sum(requested) <= 1.1 * leaf, requested


def test_a_failed_upload_leaves_the_previous_checkpoint_and_no_object(location, monkeypatch):
    url, options = location
    checkpoints.save_checkpoint(url, {"x": np.zeros(4)}, 1, storage_options=options)
    real_write = _format.write_file

    def fail_midway(out, tensors, metadata):
        if not isinstance(out, int):
            out.write(b"partial bytes that must never be visible")
        raise OSError("the network went away")

    monkeypatch.setattr(_format, "write_file", fail_midway)
    with pytest.raises(OSError, match="network went away"):
        checkpoints.save_checkpoint(url, {"x": np.ones(4)}, 2, storage_options=options)
    monkeypatch.setattr(_format, "write_file", real_write)
    store, _ = _locations.resolve(url, options)
    assert [i.name for i in store.list(url)] == ["checkpoint_1.safetensors"]
    assert checkpoints.available_steps(url, storage_options=options) == [1]


def test_a_corrupted_object_fails_its_checksum(location):
    url, options = location
    path = checkpoints.save_checkpoint(url, {"x": np.arange(1000.0)}, 1, storage_options=options)
    store: Any = _locations.resolve(url, options)[0]  # its .fs, below
    data = bytearray(store.fs.cat_file(store.strip(path)))
    data[-3] ^= 0xFF
    store.fs.pipe_file(store.strip(path), bytes(data))
    with pytest.raises(checkpoints.CheckpointFormatError, match="fails its checksum"):
        checkpoints.restore_checkpoint(url, None, storage_options=options)


def test_a_missing_backend_names_the_extra_to_install(monkeypatch):
    def missing(protocol):
        raise ImportError(f"Install gcsfs to access {protocol}://")

    monkeypatch.setattr(fsspec, "get_filesystem_class", missing)
    with pytest.raises(ImportError, match=r"pip install 'eqx_train\[gcs\]'"):
        checkpoints.save_checkpoint("gs://bucket/run", {"x": np.zeros(1)}, 1)
    with pytest.raises(ImportError, match=r"pip install 'eqx_train\[s3\]'"):
        checkpoints.latest_checkpoint("s3://bucket/run")


def test_file_urls_are_local_paths(tmp_path):
    url = f"file://{tmp_path}"
    path = checkpoints.save_checkpoint(url, {"x": np.arange(3)}, 1)
    assert path == str(tmp_path / "checkpoint_1.safetensors")
    assert checkpoints.available_steps(tmp_path) == [1]
    with pytest.raises(ValueError, match="absolute"):
        checkpoints.save_checkpoint("file://relative/dir", {"x": np.arange(3)}, 1)


def test_urls_are_normalised_or_refused_with_the_reason(tmp_path, monkeypatch):
    import pathlib

    tree = {"x": np.arange(3.0)}
    # The root of a store stays a URL; the scheme is case-insensitive.
    root = "memory://"
    fsspec.filesystem("memory").rm("/", recursive=True)
    assert checkpoints.save_checkpoint(root, tree, 1) == "memory://checkpoint_1.safetensors"
    monkeypatch.chdir(tmp_path)  # nothing may land in a local folder named "memory:"
    with checkpoints.CheckpointManager("MEMORY:///", keep_latest=2) as manager:
        manager.save(2, tree)
    assert checkpoints.available_steps("memory:///") == [1, 2]
    assert_trees_equal(checkpoints.restore_checkpoint(root, None), tree)
    assert list(tmp_path.iterdir()) == []
    fsspec.filesystem("memory").rm("/", recursive=True)
    for bad, reason in [
        ("memory://run?versionId=3", "query"),
        ("s3://", "names no bucket"),
        (pathlib.Path("memory://run"), "pass URLs as strings"),
    ]:
        with pytest.raises(ValueError, match=reason):
            checkpoints.save_checkpoint(bad, tree, 1)


def _forget(url):
    with contextlib.suppress(FileNotFoundError):
        fsspec.filesystem("memory").rm(url.split("/")[2], recursive=True)


def _hook_second_read(monkeypatch, action):
    """Runs `action` once, just before the second byte-range read of any object: after a
    restore has read a header, before it reads the data."""
    real = _fsspec.FsspecSource.read_ranges
    calls = []

    def hooked(self, jobs):
        calls.append(self.path)
        if len(calls) == 2:
            action()
        return real(self, jobs)

    monkeypatch.setattr(_fsspec.FsspecSource, "read_ranges", hooked)
    return calls


@pytest.mark.parametrize("verify", [True, False])
def test_an_overwrite_during_a_restore_never_mixes_two_versions(monkeypatch, verify):
    url = f"memory://eqx-test-mix-{verify}/run"
    n = 8192  # 32 KiB per leaf: more than the first (header) request
    old = {"a": np.zeros(n, np.float32), "b": np.ones(n, np.float32)}
    new = {"a": np.full(n, 7, np.float32), "b": np.full(n, 9, np.float32)}
    checkpoints.save_checkpoint(url, old, 1)
    calls = _hook_second_read(
        monkeypatch, lambda: checkpoints.save_checkpoint(url, new, 1, overwrite=True)
    )
    restored = checkpoints.restore_checkpoint(url, old, verify=verify)
    assert len(calls) > 2  # the header was read from the old version: the restore started over
    assert_trees_equal(restored, new)
    _forget(url)


@pytest.mark.parametrize("layout", ["single", "shards"])
@pytest.mark.parametrize("race", ["retention", "overwrite"])
def test_a_restore_racing_a_save_returns_one_whole_checkpoint(monkeypatch, layout, race):
    url = f"memory://eqx-test-race-{layout}-{race}/run"
    save = (
        checkpoints.save_checkpoint
        if layout == "single"
        else checkpoints.save_checkpoint_multiprocess
    )
    n = 8192
    old = {"a": np.zeros(n, np.float32), "b": np.ones(n, np.float32)}
    new = {"a": np.full(n, 5, np.float32), "b": np.full(n, 6, np.float32)}
    save(url, old, 1)
    if race == "retention":  # a newer step's save deletes step 1 mid-restore
        racing = lambda: save(url, new, 2, keep=1)  # noqa: E731
    else:  # an overwrite of step 1 replaces its files mid-restore
        racing = lambda: save(url, new, 1, overwrite=True)  # noqa: E731
    _hook_second_read(monkeypatch, racing)
    assert_trees_equal(checkpoints.restore_checkpoint(url, old), new)
    _forget(url)


def test_a_restore_of_a_named_checkpoint_that_disappears_raises(monkeypatch):
    url = "memory://eqx-test-vanish/run"
    path = checkpoints.save_checkpoint(url, {"a": np.zeros(8192, np.float32)}, 1)
    _hook_second_read(monkeypatch, lambda: fsspec.filesystem("memory").rm(path))
    with pytest.raises(FileNotFoundError, match="checkpoint_1"):
        checkpoints.restore_checkpoint(path, {"a": np.zeros(8192, np.float32)})
    _forget(url)


def test_two_saves_of_one_new_step_never_clobber_each_other(location, monkeypatch):
    """Without overwrite, exactly one of two concurrent saves of a new step wins (on S3 by
    a conditional write); the other raises, and what is on the store is the winner's."""
    import threading

    url, options = location
    real = _format.write_file

    def slow_write(out, *args, **kwargs):
        both_writing.wait(timeout=10)  # both saves have passed their "is it new?" check
        return real(out, *args, **kwargs)

    both_writing = threading.Barrier(2)
    monkeypatch.setattr(_format, "write_file", slow_write)
    outcome: dict[float, str] = {}

    def save(value):
        try:
            checkpoints.save_checkpoint(url, {"x": np.full(4, value)}, 5, storage_options=options)
            outcome[value] = "ok"
        except ValueError as error:
            outcome[value] = str(error)

    threads = [threading.Thread(target=save, args=(v,)) for v in (1.0, 2.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [v for v, o in outcome.items() if o == "ok"]
    assert len(winners) == 1, outcome
    (loser,) = set(outcome) - set(winners)
    assert "appeared" in outcome[loser] and url in outcome[loser]
    restored = checkpoints.restore_checkpoint(url, None, storage_options=options)
    np.testing.assert_array_equal(restored["x"], np.full(4, winners[0]))


def test_client_errors_name_the_url(monkeypatch):
    pytest.importorskip("s3fs")
    for variable in [v for v in os.environ if v.startswith("AWS_")]:
        monkeypatch.delenv(variable)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    options = {  # a closed port: the client's own error, at once
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1},
        "anon": True,
    }
    with pytest.raises(OSError, match=r"s3://bkt/run: EndpointConnectionError"):
        checkpoints.latest_checkpoint("s3://bkt/run", storage_options=options)
    with pytest.raises(OSError, match=r"s3://bkt/run.*EndpointConnectionError"):
        checkpoints.restore_checkpoint("s3://bkt/run", None, storage_options=options)


def test_leftovers_of_writers_on_other_hosts_go_only_after_the_stale_limit(monkeypatch):
    """A bucket belongs to no host: an uncommitted piece or an upload marker written from
    another machine may be a live save's, and is removed only once older than `STALE_S`."""
    import types

    from eqx_train.checkpoints.pipeline import _directory

    url = "memory://eqx-test-stale/run"
    fs = fsspec.filesystem("memory")
    token = f"ffffffff-12345-{'0' * 16}"  # a writer on another host
    piece = f"{url}/checkpoint_5.shards/process_00001.{token}.safetensors"
    marker = f"{url}/.checkpoint_7.safetensors.tmp-{token}"
    assert _names.parse_piece_file(piece.rsplit("/", 1)[1]) == (1, token)
    assert _names.parse_temp(marker.rsplit("/", 1)[1]) == (
        "checkpoint_7.safetensors", "ffffffff", 12345,
    )  # fmt: skip
    for key in (piece, marker):
        fs.pipe_file(key.split("://")[1], b"")
    checkpoints.save_checkpoint(url, {"x": np.zeros(2)}, 1)
    assert fs.exists(piece.split("://")[1]) and fs.exists(marker.split("://")[1])
    later = time.time() + 2 * _directory.STALE_S
    monkeypatch.setattr(_directory, "time", types.SimpleNamespace(time=lambda: later))
    checkpoints.save_checkpoint(url, {"x": np.zeros(2)}, 2)
    assert not fs.exists(piece.split("://")[1]) and not fs.exists(marker.split("://")[1])
    assert checkpoints.available_steps(url) == [2]
    _forget(url)


def test_multiprocess_saves_to_an_object_store_refuse_a_timeout_beyond_the_stale_limit():
    with pytest.raises(ValueError, match="timeout_s=7200 is too long for an object store"):
        checkpoints.save_checkpoint_multiprocess(
            "memory://eqx-test-timeout/run", {"x": np.zeros(2)}, 1, timeout_s=7200
        )


# ------------------------------------------------------------------ S3 only


KILLED_UPLOAD = """
import json, os, signal, sys
import numpy as np
import s3fs.core
from eqx_train import checkpoints
from eqx_train.checkpoints.storage import _fsspec

url, options = sys.argv[1], json.loads(sys.argv[2])
_fsspec._PART_BYTES = 5 << 20  # S3's smallest part: the upload has several
checkpoints.save_checkpoint(url, {"x": np.zeros(10)}, 1, storage_options=options)
print("OLD-SAVED PID", os.getpid(), flush=True)
real_upload = s3fs.core.S3File._upload_chunk

def upload_then_die(self, final=False):
    result = real_upload(self, final)
    if self.parts and not final:
        print(f"KILL-POINT after part {len(self.parts)} of {self.path}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return result

s3fs.core.S3File._upload_chunk = upload_then_die
checkpoints.save_checkpoint(url, {"x": np.ones(3 << 20)}, 2, storage_options=options)
print("UNREACHABLE", flush=True)
"""


def test_sigkill_mid_upload_keeps_the_previous_checkpoint_and_the_next_save_cleans_up(
    s3_server, s3_bucket
):
    import json

    url, options = f"{s3_bucket}/run", s3_server.storage_options
    child = subprocess.run(
        [sys.executable, "-c", KILLED_UPLOAD, url, json.dumps(options)],
        capture_output=True, text=True, timeout=120, env=s3_server.env,
    )  # fmt: skip
    out = child.stdout + child.stderr
    assert child.returncode == -signal.SIGKILL, out
    assert (
        out.index("OLD-SAVED") < out.index("KILL-POINT after part 1") and "UNREACHABLE" not in out
    )
    store: Any = _locations.resolve(url, options)[0]  # its .fs, below
    bucket = s3_bucket.split("://")[1]
    pending = store.fs.list_multipart_uploads(bucket)
    # Proof that the kill landed mid-upload: a multipart upload of step 2 is open.
    assert [u["Key"] for u in pending] == ["run/checkpoint_2.safetensors"], pending
    # Besides step 1, only the marker naming the killed upload's writer (hidden, never a
    # checkpoint name).
    names = sorted(i.name for i in store.list(url))
    assert names[1] == "checkpoint_1.safetensors" and len(names) == 2, names
    assert cast(tuple, _names.parse_temp(names[0]))[::2] == (
        "checkpoint_2.safetensors",
        child_pid(out),
    )
    assert checkpoints.available_steps(url, storage_options=options) == [1]
    np.testing.assert_array_equal(
        checkpoints.restore_checkpoint(url, None, storage_options=options)["x"], np.zeros(10)
    )
    checkpoints.save_checkpoint(url, {"x": np.full(4, 3.0)}, 3, storage_options=options)
    assert store.fs.list_multipart_uploads(bucket) == []
    assert [i.name for i in store.list(url)] == ["checkpoint_3.safetensors"]
    assert checkpoints.available_steps(url, storage_options=options) == [3]


def child_pid(out: str) -> int:
    return int(out.split("PID ")[1].split()[0])


LIVE_UPLOAD = """
import json, os, sys
import numpy as np
import s3fs.core
from eqx_train import checkpoints
from eqx_train.checkpoints.storage import _fsspec

url, options = sys.argv[1], json.loads(sys.argv[2])
_fsspec._PART_BYTES = 5 << 20
real_upload = s3fs.core.S3File._upload_chunk

def upload_then_wait(self, final=False):
    result = real_upload(self, final)
    if len(self.parts) == 1 and not final:
        print("PAUSED after part 1", flush=True)
        sys.stdin.readline()  # until the test has tried to clean up
    return result

s3fs.core.S3File._upload_chunk = upload_then_wait
checkpoints.save_checkpoint(url, {"x": np.ones(3 << 20)}, 2, keep=9, storage_options=options)
print("SAVED", flush=True)
"""


def test_cleanup_never_aborts_the_upload_of_a_live_writer(s3_server, s3_bucket):
    """A second process (an evaluator opening the run, or a save of another step) cleans up
    killed uploads only: the live writer's half-sent upload survives and completes."""
    import json

    url, options = f"{s3_bucket}/run", s3_server.storage_options
    checkpoints.save_checkpoint(url, {"x": np.zeros(10)}, 1, storage_options=options)
    with subprocess.Popen(
        [sys.executable, "-c", LIVE_UPLOAD, url, json.dumps(options)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=s3_server.env,
    ) as writer:  # fmt: skip
        assert writer.stdin is not None and writer.stdout is not None  # both are pipes
        assert writer.stdout.readline() == "PAUSED after part 1\n"
        store: Any = _locations.resolve(url, options)[0]  # its .fs, below
        bucket = s3_bucket.split("://")[1]
        assert len(store.fs.list_multipart_uploads(bucket)) == 1  # mid-upload, for sure
        with checkpoints.CheckpointManager(url, keep_latest=5, storage_options=options) as m:
            m.save(3, {"x": np.zeros(10)})
        checkpoints.save_checkpoint(url, {"x": np.zeros(10)}, 4, keep=5, storage_options=options)
        assert len(store.fs.list_multipart_uploads(bucket)) == 1
        writer.stdin.write("go on\n")
        writer.stdin.flush()
        assert writer.stdout.readline() == "SAVED\n"
    assert checkpoints.available_steps(url, storage_options=options) == [1, 2, 3, 4]
    assert sorted(i.name for i in store.list(url)) == [
        f"checkpoint_{step}.safetensors" for step in (1, 2, 3, 4)
    ]


def test_gs_urls_take_the_same_code_path_as_s3(s3_server, s3_bucket, monkeypatch):
    """No GCS server runs here: `gs://` is routed to the S3 server through an fsspec
    filesystem registered for the protocol, which is exactly how gcsfs plugs in. Nothing in
    eqx_train distinguishes the two."""
    import s3fs

    class GsBackedByS3(s3fs.S3FileSystem):
        protocol = ("gs", "gcs")

    monkeypatch.setitem(sys.modules["fsspec.registry"]._registry, "gs", GsBackedByS3)
    bucket = s3_bucket.split("://")[1]
    url, options = f"gs://{bucket}/run", s3_server.storage_options
    tree = {"w": np.arange(12.0).reshape(3, 4), "step": 7}
    path = checkpoints.save_checkpoint(url, tree, 7, storage_options=options)
    assert path == f"{url}/checkpoint_7.safetensors"
    assert checkpoints.available_steps(url, storage_options=options) == [7]
    assert_trees_equal(checkpoints.restore_checkpoint(url, tree, storage_options=options), tree)
    # The object really is in the S3 bucket.
    s3 = s3fs.S3FileSystem(**options)
    assert s3.ls(f"{bucket}/run") == [f"{bucket}/run/checkpoint_7.safetensors"]


def test_the_credentials_example_of_cloud_storage_md_runs_against_the_server(s3_server, s3_bucket):
    """docs/cloud_storage.md's `storage_options` block, with this server's endpoint, keys
    and bucket in place of the placeholders."""
    import pathlib
    import re

    page = pathlib.Path(__file__).parent.parent / "docs" / "cloud_storage.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    (block,) = [b for b in blocks if "storage_options=options" in b]
    bucket = s3_bucket.split("://")[1]
    code = (
        block.replace("my-access-key", s3_server.key)
        .replace("my-secret-key", s3_server.secret)
        .replace("http://127.0.0.1:8333", s3_server.endpoint_url)
        .replace("my-bucket", bucket)
    )
    params = {"w": np.ones((2, 3), np.float32)}
    namespace = {"checkpoints": checkpoints, "params": params}
    exec(compile(code, str(page), "exec"), namespace)
    assert namespace["manager"].latest_step() == 400
    assert_trees_equal(
        checkpoints.restore_checkpoint(
            s3_bucket + "/run", params, storage_options=s3_server.storage_options
        ),
        params,
    )
