"""The object-store test server (tests/support/s3_server.py): a real, authenticated S3 endpoint on
127.0.0.1 that speaks what checkpoints need (put, get, list, delete, byte ranges,
multipart uploads), and leaves no process, port or file behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from tests.support.helpers import run_then_sigkill
from tests.support.s3_server import SeaweedS3

s3fs = pytest.importorskip("s3fs")

MiB = 1 << 20


@pytest.fixture
def fs(s3_server):
    # A private instance without a listing cache, so that one test's listings never
    # answer another's.
    return s3fs.S3FileSystem(
        **s3_server.storage_options, skip_instance_cache=True, use_listings_cache=False
    )


def _payload(size: int, seed: int = 0) -> bytes:
    return bytes((seed + i * 7) % 251 for i in range(min(size, 251))) * (size // 251 + 1)


def test_objects_can_be_put_read_listed_and_deleted(fs, s3_bucket):
    bucket = s3_bucket.removeprefix("s3://")
    fs.pipe_file(f"{bucket}/run/a.bin", b"alpha")
    fs.pipe_file(f"{bucket}/run/b.bin", b"")
    fs.pipe_file(f"{bucket}/odd name+%.bin", b"odd")

    assert fs.cat_file(f"{bucket}/run/a.bin") == b"alpha"
    assert fs.cat_file(f"{bucket}/run/b.bin") == b""
    assert fs.cat_file(f"{bucket}/odd name+%.bin") == b"odd"
    assert sorted(fs.find(bucket)) == [
        f"{bucket}/odd name+%.bin",
        f"{bucket}/run/a.bin",
        f"{bucket}/run/b.bin",
    ]
    assert fs.size(f"{bucket}/run/a.bin") == 5

    fs.rm(f"{bucket}/run/a.bin")
    assert not fs.exists(f"{bucket}/run/a.bin")
    assert fs.find(bucket) == [f"{bucket}/odd name+%.bin", f"{bucket}/run/b.bin"]


def test_range_reads_return_exactly_the_requested_bytes(fs, s3_bucket):
    path = f"{s3_bucket.removeprefix('s3://')}/blob"
    data = _payload(3 * MiB + 17)
    fs.pipe_file(path, data)

    assert fs.cat_file(path, start=MiB, end=MiB + 10) == data[MiB : MiB + 10]
    assert fs.cat_file(path, start=len(data) - 3) == data[-3:]
    starts, ends = [0, 5, 2 * MiB, len(data) - 1], [1, MiB + 5, 3 * MiB, len(data)]
    assert fs.cat_ranges([path] * 4, starts, ends) == [
        data[s:e] for s, e in zip(starts, ends, strict=True)
    ]


def test_multipart_upload_is_invisible_until_it_completes(fs, s3_bucket):
    bucket = s3_bucket.removeprefix("s3://")
    path = f"{bucket}/big"
    data = _payload(12 * MiB + 1, seed=3)
    with fs.open(path, "wb", block_size=5 * MiB) as f:
        f.write(data[: 11 * MiB])
        # Two 5 MiB parts are on the server by now, the upload not yet completed.
        assert [u["Key"] for u in fs.list_multipart_uploads(bucket)] == ["big"]
        assert not fs.exists(path)
        f.write(data[11 * MiB :])

    assert fs.cat_file(path) == data
    assert fs.list_multipart_uploads(bucket) == []


def test_a_writer_killed_mid_upload_leaves_no_object_only_an_abortable_upload(
    s3_server, fs, s3_bucket
):
    bucket = s3_bucket.removeprefix("s3://")
    # The child prints 1 once two 5 MiB parts are on the server, then waits to be killed.
    script = (
        "import json, sys, time, s3fs; options, path = json.loads(sys.argv[1]);"
        "f = s3fs.S3FileSystem(**options).open(path, 'wb', block_size=5 << 20);"
        "f.write(b'k' * (11 << 20)); print(1, flush=True); time.sleep(600)"
    )
    argument = json.dumps([s3_server.storage_options, f"{bucket}/killed"])
    run_then_sigkill(script, argument, after_line=1, delay=0)

    assert fs.find(bucket) == []
    assert [u["Key"] for u in fs.list_multipart_uploads(bucket)] == ["killed"]
    fs.clear_multipart_uploads(bucket)
    assert fs.list_multipart_uploads(bucket) == []
    assert fs.find(bucket) == []


@pytest.mark.parametrize("size", [10, 12 * MiB], ids=["single-put", "multipart"])
def test_create_mode_refuses_to_overwrite_an_object(fs, s3_bucket, size):
    # If-None-Match: * on PutObject and CompleteMultipartUpload: a no-clobber commit.
    path = f"{s3_bucket.removeprefix('s3://')}/once"
    fs.pipe_file(path, b"first")
    with pytest.raises(OSError, match="pre-condition"):
        fs.pipe_file(path, b"x" * size, mode="create", chunksize=5 * MiB)
    assert fs.cat_file(path) == b"first"
    assert fs.list_multipart_uploads(s3_bucket.removeprefix("s3://")) == []


def test_requests_without_the_right_secret_are_refused(s3_server, s3_bucket):
    path = f"{s3_bucket.removeprefix('s3://')}/secret"
    s3fs.S3FileSystem(**s3_server.storage_options, skip_instance_cache=True).pipe_file(path, b"x")
    client = {"client_kwargs": s3_server.storage_options["client_kwargs"]}
    wrong = s3fs.S3FileSystem(key=s3_server.key, secret="wrong", skip_instance_cache=True, **client)
    anonymous = s3fs.S3FileSystem(anon=True, skip_instance_cache=True, **client)

    for fs in (wrong, anonymous):
        with pytest.raises(PermissionError):
            fs.cat_file(path)
        with pytest.raises(PermissionError):
            fs.pipe_file(path + "-2", b"y")


def test_s3_bucket_is_a_new_empty_bucket_on_the_server(fs, s3_server, s3_bucket):
    bucket = s3_bucket.removeprefix("s3://")
    assert s3_bucket.startswith("s3://")
    assert fs.ls(bucket) == []
    assert s3_server.create_bucket(bucket + "-other") != s3_bucket


def test_env_points_a_subprocess_at_the_server(s3_server, s3_bucket):
    path = f"{s3_bucket.removeprefix('s3://')}/from-env"
    script = (
        "import sys, s3fs; fs = s3fs.S3FileSystem(); fs.pipe_file(sys.argv[1], b'env');"
        "print(fs.cat_file(sys.argv[1]).decode())"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FSSPEC_"))}
    result = subprocess.run(
        [sys.executable, "-c", script, path],
        env={**env, **s3_server.env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "env"


def _socket_paths(ports: Mapping[str, int]) -> list[Path]:
    return [
        Path(f"/tmp/seaweedfs-{flag.split('.')[0]}-grpc-{port}.sock")
        for flag, port in ports.items()
        if flag.endswith(".grpc")
    ]


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # a zombie no longer runs; only its parent may reap it


def _refuses_connections(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.slow
def test_stop_kills_the_server_and_removes_its_files():
    with SeaweedS3() as server:
        assert server.process is not None
        pid, directory = server.process.pid, server.directory
        assert not _gone(pid)

    assert _gone(pid)
    assert all(_refuses_connections(port) for port in server.ports.values())
    assert not directory.exists()
    assert not any(path.exists() for path in _socket_paths(server.ports))


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="parent-death signal is Linux only")
def test_server_dies_with_the_process_that_started_it():
    # The owner is SIGKILLed, so none of its cleanup runs: the kernel must end the server.
    # (It need not wait for readiness: the signal is armed before `launch()` returns.)
    script = (
        "import json, sys, time; sys.path.insert(0, sys.argv[1]);"
        "from tests.support.s3_server import SeaweedS3; s = SeaweedS3(); s.launch();"
        "print(json.dumps([s.process.pid, str(s.directory), s.ports]), flush=True);"
        "time.sleep(600)"
    )
    root = str(Path(__file__).parent.parent)
    owner = subprocess.Popen(
        [sys.executable, "-c", script, root], stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None
        pid, directory, ports = json.loads(owner.stdout.readline())
        assert not _gone(pid)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
        deadline = time.monotonic() + 10
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(pid), f"weed (pid {pid}) outlived the process that started it"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()
    for path in [Path(directory), *_socket_paths(ports)]:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
