"""A restore reads the tensors of a local file on a pool of reading threads the process
shares; where cores are left over, a large tensor in parts read at once, its checksum
computed in order as the parts arrive (`format._part_reads`).

Here parts are made small (and tensors of over two parts split), so that every tensor below
is read in several parts; each test runs on a file whose tensors are checksummed in parts of
that size (format version 3), each part verified by its reader, and on one with a single
digest per tensor (as before version 3), verified in order by the restoring thread.
"""

from __future__ import annotations

import os
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints import CheckpointFormatError
from eqx_train.checkpoints.format import _checksums, _part_reads
from eqx_train.checkpoints.format._reader import FileReader
from eqx_train.checkpoints.pipeline import _window
from eqx_train.checkpoints.storage._local_files import LocalSource

PART = 64 * 1024


@pytest.fixture(params=["digest per part", "digest per tensor"])
def parts(request, monkeypatch) -> list[tuple[str, int, int]]:
    """Splits every tensor over two parts into parts of 64 KiB, as for a file in memory;
    files are written with a digest per part of 64 KiB, or one per tensor (the param);
    returns each read made: (thread name, file offset, bytes)."""
    monkeypatch.setattr(_part_reads, "SPLIT_BYTES", 2 * PART)
    monkeypatch.setattr(_part_reads, "PART_BYTES", PART)
    per_part = request.param == "digest per part"
    monkeypatch.setattr(_checksums, "PART_BYTES", PART if per_part else 1 << 62)
    monkeypatch.setattr(LocalSource, "cached", lambda self, offset, length: True)
    reads: list[tuple[str, int, int]] = []
    read_into = LocalSource.read_into

    def recorded(self, view, offset):
        reads.append((threading.current_thread().name, offset, len(view)))
        return read_into(self, view, offset)

    monkeypatch.setattr(LocalSource, "read_into", recorded)
    return reads


def _state() -> dict[str, Any]:
    # 16 MiB in all: `read_many` reads a group this large on several threads.
    return {
        "f32": jnp.arange(3 * 2**20, dtype=jnp.float32),
        "bf16": jnp.linspace(-3, 3, 2**20 + 7, dtype=jnp.bfloat16),
        "c64": (jnp.arange(2**19, dtype=jnp.float32) * (1 - 1j)).astype(jnp.complex64),
        "i8": (jnp.arange(2**20 + 13) % 251).astype(jnp.int8),
        "small": jnp.arange(10.0),
    }


def _zeros(state: Any) -> Any:
    return jax.tree.map(jnp.zeros_like, state)


def _tensor(path: Any, name: str) -> tuple[int, int]:
    with FileReader(str(path)) as reader:
        info = reader.tensors[name]
        return info.start, info.nbytes


def test_large_tensors_are_read_in_parts_by_the_shared_readers(tmp_path, parts):
    state = _state()
    path = checkpoints.save_checkpoint(tmp_path, state, 0)
    restored = checkpoints.restore_checkpoint(tmp_path, _zeros(state))
    for name, value in state.items():
        assert np.array_equal(np.asarray(restored[name]), np.asarray(value)), name
    start, nbytes = _tensor(path, "f32")
    f32_reads = sorted((o, n) for _, o, n in parts if start <= o < start + nbytes)
    assert f32_reads == [(start + i, min(PART, nbytes - i)) for i in range(0, nbytes, PART)]
    assert {t for t, o, _ in parts if start <= o < start + nbytes} <= {
        f"eqx_train-read_{i}" for i in range(_part_reads.READERS)
    }


def test_a_tensor_still_on_the_disk_is_read_whole_front_to_back(tmp_path, parts, monkeypatch):
    state = _state()
    path = checkpoints.save_checkpoint(tmp_path, state, 0)
    f32_start, f32_bytes = _tensor(path, "f32")
    asked = []

    def cached(self, offset, length):  # only f32 is still on the disk
        asked.append((offset, length))
        return offset != f32_start

    monkeypatch.setattr(LocalSource, "cached", cached)
    restored = checkpoints.restore_checkpoint(tmp_path, _zeros(state))
    for name, value in state.items():
        assert np.array_equal(np.asarray(restored[name]), np.asarray(value)), name
    assert (f32_start, f32_bytes) in asked
    f32_reads = sorted(o - f32_start for _, o, _ in parts if f32_start <= o < f32_start + f32_bytes)
    # One stream of consecutive chunks (the checksum's), one thread: not parts at once.
    assert len({t for t, o, _ in parts if f32_start <= o < f32_start + f32_bytes}) == 1
    assert f32_reads[0] == 0 and len(f32_reads) < f32_bytes // PART
    start, nbytes = _tensor(path, "i8")  # in memory: in parts as before
    assert len([o for _, o, _ in parts if start <= o < start + nbytes]) == -(-nbytes // PART)
    # Asked only of the tensors that may be cut: each question costs two reads.
    assert _tensor(path, "small") not in asked
    assert all(length > 2 * PART for _, length in asked)


def _file_system(path: Any) -> str:
    """The type of the file system `path` is on (Linux's mount table), or '' if unknown."""
    best, kind = "", ""
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            _, point, fs_type = line.split()[:3]
            if str(path).startswith(point.rstrip("/") + "/") and len(point) > len(best):
                best, kind = point, fs_type
    return kind


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="Linux's RWF_NOWAIT reads")
def test_a_file_says_whether_its_bytes_are_in_memory(tmp_path):
    if _file_system(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("a file in memory stays there: nothing to drop")
    path = tmp_path / "bytes"
    data = np.random.default_rng(0).bytes(64 << 20)  # far more than a readahead window
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())  # clean pages: the kernel drops them when asked
    source = LocalSource(str(path), CheckpointFormatError)
    try:
        assert source.cached(0, len(data))  # just written
        # Advice the kernel may take late: pages still in a CPU's LRU batch are dropped by a
        # later call, once they have been drained to the LRU lists.
        for _ in range(20):
            os.posix_fadvise(source.fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if not source.cached(0, len(data)):
                break
            time.sleep(0.05)
        assert not source.cached(0, len(data))
        source.read_into(memoryview(bytearray(4096)), len(data) - 4096)
        assert source.cached(len(data) - 4096, 4096)  # the page just read
    finally:
        source.close()


@pytest.mark.parametrize("where", ["first part", "a middle part", "last part"])
def test_a_corrupt_part_of_a_tensor_fails_its_checksum(tmp_path, parts, where):
    state = _state()
    path = checkpoints.save_checkpoint(tmp_path, state, 0)
    start, nbytes = _tensor(path, "bf16")
    offset = {"first part": 10, "a middle part": nbytes // 2, "last part": nbytes - 3}[where]
    with open(path, "r+b") as file:
        file.seek(start + offset)
        byte = file.read(1)
        file.seek(start + offset)
        file.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointFormatError, match="tensor 'bf16' fails its checksum"):
        checkpoints.restore_checkpoint(tmp_path, _zeros(state))
    # Unverified, the same bytes are read as they are: the parts are all there.
    restored = checkpoints.restore_checkpoint(tmp_path, _zeros(state), verify=False)
    assert np.array_equal(np.asarray(restored["f32"]), np.asarray(state["f32"]))
    assert not np.array_equal(np.asarray(restored["bf16"]), np.asarray(state["bf16"]))


def test_a_failed_part_stops_the_reads_before_the_error_is_raised(tmp_path, parts, monkeypatch):
    state = _state()
    path = checkpoints.save_checkpoint(tmp_path, state, 0)
    start, _ = _tensor(path, "f32")
    running = []
    read_into = LocalSource.read_into

    def failing(self, view, offset):
        running.append(1)
        try:
            if offset == start + 2 * PART:
                raise OSError(5, "Input/output error")
            time.sleep(0.001)
            return read_into(self, view, offset)
        finally:
            running.pop()

    monkeypatch.setattr(LocalSource, "read_into", failing)
    with pytest.raises(OSError, match="Input/output error"):
        checkpoints.restore_checkpoint(tmp_path, _zeros(state))
    assert running == []  # no reader still writes into a buffer the restore let go
    assert _window.held_bytes() == 0


def test_a_submit_that_fails_midway_still_waits_for_the_parts_already_submitted(monkeypatch):
    class FailingPool:  # the third submit fails (an interpreter shutting down, say)
        def __init__(self):
            self.pool, self.submits = ThreadPoolExecutor(4), 0

        def submit(self, *args):
            self.submits += 1
            if self.submits == 3:
                raise RuntimeError("cannot schedule new futures after interpreter shutdown")
            return self.pool.submit(*args)

    monkeypatch.setattr(_part_reads, "_readers", FailingPool)
    monkeypatch.setattr(_part_reads, "SPLIT_BYTES", 2 * PART)
    monkeypatch.setattr(_part_reads, "PART_BYTES", PART)
    filling = []

    def read_into(view, offset):
        filling.append(offset)
        time.sleep(0.2)
        view[:] = b"x" * len(view)
        filling.remove(offset)

    info = types.SimpleNamespace(name="t", nbytes=4 * PART, start=0, checksum=None)
    out = np.zeros(4 * PART, np.uint8)
    with pytest.raises(RuntimeError, match="cannot schedule"):
        _part_reads.read_tensors(
            lambda *args: None, read_into, [(info, out, out.data, None)], True, ValueError
        )
    assert filling == []  # no read still writes into `out`, which the caller lets go


def test_a_truncated_file_names_the_file_from_a_part(tmp_path, parts):
    state = _state()
    path = checkpoints.save_checkpoint(tmp_path, state, 0)
    start, nbytes = _tensor(path, "f32")
    with open(path, "r+b") as file:
        file.truncate(start + nbytes // 2)
    with pytest.raises(CheckpointFormatError, match="truncated"):
        checkpoints.restore_checkpoint(tmp_path, _zeros(state))


def test_without_threaded_reads_every_read_is_made_by_the_restoring_thread(tmp_path, parts):
    state = _state()
    checkpoints.save_checkpoint(tmp_path, state, 0)
    parts.clear()
    restored = checkpoints.restore_checkpoint(tmp_path, _zeros(state), threaded_reads=False)
    assert np.array_equal(np.asarray(restored["c64"]), np.asarray(state["c64"]))
    assert parts and not [t for t, _, _ in parts if t.startswith("eqx_train-read_")]


def test_reading_and_verifying_show_in_the_stage_breakdown(tmp_path, parts):
    state = _state()
    checkpoints.save_checkpoint(tmp_path, state, 0)
    with _window.stage_times() as times:
        checkpoints.restore_checkpoint(tmp_path, _zeros(state))
    assert times["read"] > 0 and times["verify"] > 0


def test_a_forked_child_gets_a_pool_of_its_own(monkeypatch):
    pool = _part_reads._readers()
    assert _part_reads._readers() is pool
    monkeypatch.setattr(_part_reads.os, "getpid", lambda: -1)  # as in a forked child
    assert _part_reads._readers() is not pool


def test_parts_tile_the_bytes_they_split():
    view = memoryview(bytes(range(256)) * 5)
    split = _part_reads.split(view, 1000, part_bytes=300)
    assert [(len(p), o) for p, o in split] == [
        (300, 1000),
        (300, 1300),
        (300, 1600),
        (300, 1900),
        (80, 2200),
    ]
    assert b"".join(bytes(p) for p, _ in split) == bytes(view)
