"""A tensor larger than one part is checksummed part by part (format version 3): each part of
`PART_BYTES` has its own xxh3-64, seeded with the tensor's dtype, shape and the part's index,
so that the threads reading a tensor each verify the part they read. Every corruption a single
digest caught is still caught (a flipped bit in any part, two parts swapped, two digests
swapped, a crafted table), older files with one digest per tensor verify as before, and a
reader that only knows version 2 refuses such a file as newer, never as corrupt.

Parts are made 64 KiB here (the writer's constant, patched), so that small tensors have many.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct
import threading
import zlib
from typing import Any

import equinox as eqx
import fsspec
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import xxhash

from eqx_train import checkpoints
from eqx_train.checkpoints import CheckpointFormatError, NewerFormatError
from eqx_train.checkpoints.format import _checksums, _header_codes, _part_reads, _reader
from eqx_train.checkpoints.format._reader import FileReader
from eqx_train.checkpoints.storage._local_files import LocalSource
from tests.support.helpers import assert_trees_equal, latest_path

PART = 64 * 1024
CHECKSUMS = "eqx_train.checksums"
VERSION = "eqx_train.format_version"


@pytest.fixture(autouse=True)
def small_parts(monkeypatch):
    monkeypatch.setattr(_checksums, "PART_BYTES", PART)


def _state() -> dict[str, Any]:
    return {
        "w": jnp.arange(5 * PART // 4 + 3, dtype=jnp.float32),  # 6 parts, the last short
        "bf16": jnp.linspace(-2, 2, 3 * PART // 2, dtype=jnp.bfloat16),  # exactly 3 parts
        "c128": np.arange(PART // 16 + 5) * (1 - 2j),  # complex128 stored as F64 pairs
        "small": jnp.arange(10.0),
    }


def _header(path: Any) -> dict[str, Any]:
    with open(path, "rb") as file:
        return json.loads(file.read(struct.unpack("<Q", file.read(8))[0]))


def _table(path: Any) -> dict[str, Any]:
    return json.loads(_header(path)["__metadata__"][CHECKSUMS])


def _edit_table(path: Any, edit) -> None:
    """Rewrites the checksum table of `path` through `edit(table)` (the table is what seals
    the rest, so nothing else needs redoing; offsets are relative to the data section)."""
    raw = pathlib.Path(path).read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + length])
    table = json.loads(header["__metadata__"][CHECKSUMS])
    edit(table)
    header["__metadata__"][CHECKSUMS] = json.dumps(table)
    text = json.dumps(header).encode()
    pathlib.Path(path).write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])


def _span(path: Any, name: str) -> tuple[int, int]:
    with FileReader(str(path)) as reader:
        return reader.tensors[name].start, reader.tensors[name].nbytes


def _read_in_parts(monkeypatch) -> None:
    """Every tensor over two parts read part by part on the shared readers."""
    monkeypatch.setattr(_reader, "_PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(_part_reads, "SPLIT_BYTES", 2 * PART)
    monkeypatch.setattr(LocalSource, "cached", lambda self, offset, length: True)


def _zeros(state: Any) -> Any:
    return jax.tree.map(
        lambda x: np.zeros_like(x) if isinstance(x, np.ndarray) else jnp.zeros_like(x), state
    )


# ------------------------------------------------------------------ what is written


def test_each_part_of_a_large_tensor_has_its_own_digest_and_the_file_is_version_3(tmp_path):
    path = checkpoints.save_checkpoint(tmp_path, _state(), 1)
    table, metadata = _table(path), _header(path)["__metadata__"]
    assert metadata[VERSION] == "3" and table["part_bytes"] == PART
    assert [len(table["tensors"][n]) for n in ("w", "bf16", "c128")] == [6, 3, 2]
    assert isinstance(table["tensors"]["small"], str)


@pytest.mark.parametrize(
    ("tree", "version"),
    [
        ({"a": np.ones(PART // 8)}, "1"),  # exactly one part: one digest
        ({"a": np.ones(PART // 8, np.complex64)}, "2"),
        ({"a": np.ones(PART // 8 + 1)}, "3"),
        ({"a": np.ones(PART // 8 + 1), "c": np.ones(2, np.complex64)}, "3"),
    ],
    ids=["one-part", "complex-one-part", "two-parts", "complex-and-two-parts"],
)
def test_a_file_is_written_as_the_lowest_version_that_holds_it(tmp_path, tree, version):
    path = checkpoints.save_checkpoint(tmp_path, tree, 1)
    assert _header(path)["__metadata__"][VERSION] == version
    assert "part_bytes" in _table(path) or version != "3"


def test_part_digests_are_xxh3_seeded_with_dtype_shape_and_index_as_documented(tmp_path):
    state = _state()
    path = checkpoints.save_checkpoint(tmp_path, state, 1)
    data = np.asarray(state["w"]).tobytes()
    start, nbytes = _span(path, "w")
    expected = [
        xxhash.xxh3_64_hexdigest(
            data[i : i + PART], seed=zlib.crc32(f"F32{[nbytes // 4]}#{i // PART}".encode())
        )
        for i in range(0, nbytes, PART)
    ]
    assert _table(path)["tensors"]["w"] == expected
    small = np.asarray(state["small"]).tobytes()
    seed = zlib.crc32(f"F32{[10]}".encode())
    assert _table(path)["tensors"]["small"] == xxhash.xxh3_64_hexdigest(small, seed=seed)


def test_an_equinox_model_with_state_bfloat16_and_a_typed_key_round_trips(tmp_path):
    model, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(PART // 2, "batch", mode="batch")
    tree = {
        "model": model,
        "state": state,
        "emb": jnp.ones((PART // 64, 48), ml_dtypes.bfloat16),  # 3 parts
        "key": jax.random.key(3),
    }
    path = checkpoints.save_checkpoint(tmp_path, tree, 1)
    assert _header(path)["__metadata__"][VERSION] == "3"
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, tree), tree)


# ------------------------------------------------------------------ what is caught


@pytest.mark.parametrize("threaded", [True, False], ids=["part-readers", "one-thread"])
@pytest.mark.parametrize("part", [0, 3, 5])
def test_a_flipped_bit_in_any_part_names_the_tensor_and_the_part(
    tmp_path, monkeypatch, threaded, part
):
    _read_in_parts(monkeypatch)
    state = _state()
    path = checkpoints.save_checkpoint(tmp_path, state, 1)
    start, nbytes = _span(path, "w")
    with open(path, "r+b") as file:
        file.seek(start + part * PART + 7)
        byte = file.read(1)
        file.seek(start + part * PART + 7)
        file.write(bytes([byte[0] ^ 0x10]))
    end = min((part + 1) * PART, nbytes)  # the last part is 12 bytes
    match = (
        rf"tensor 'w' fails its checksum in its part {part} \(its bytes {part * PART} to {end}\)"
    )
    with pytest.raises(CheckpointFormatError, match=match) as caught:
        checkpoints.restore_checkpoint(tmp_path, _zeros(state), threaded_reads=threaded)
    assert str(path) in str(caught.value)


def test_two_parts_swapped_in_the_file_are_caught(tmp_path):
    state = {"w": jnp.arange(4 * PART // 4, dtype=jnp.float32)}
    path = checkpoints.save_checkpoint(tmp_path, state, 1)
    start, _ = _span(path, "w")
    raw = bytearray(pathlib.Path(path).read_bytes())
    first, second = slice(start, start + PART), slice(start + PART, start + 2 * PART)
    raw[first], raw[second] = raw[second], raw[first]
    pathlib.Path(path).write_bytes(raw)
    with pytest.raises(CheckpointFormatError, match="tensor 'w' fails its checksum"):
        checkpoints.restore_checkpoint(tmp_path, _zeros(state))


def test_two_digests_swapped_in_the_table_are_caught(tmp_path):
    state = _state()
    path = checkpoints.save_checkpoint(tmp_path, state, 1)

    def swap(table):
        digests = table["tensors"]["w"]
        digests[1], digests[2] = digests[2], digests[1]

    _edit_table(path, swap)
    with pytest.raises(CheckpointFormatError, match="tensor 'w' fails its checksum"):
        checkpoints.restore_checkpoint(tmp_path, _zeros(state))


def _set(key: str, value: Any):
    def edit(table):
        table[key] = value

    return edit


def _drop_part_bytes(table):
    del table["part_bytes"]


def _one_digest_too_many(table):
    table["tensors"]["w"].append("0" * 16)


def _one_digest_short(table):
    table["tensors"]["w"].pop()


def _empty_list(table):
    table["tensors"]["w"] = []


def _short_digest(table):
    table["tensors"]["w"][0] = "abc"


def _number_digest(table):
    table["tensors"]["w"][0] = 12345678901234567


CRAFTED = {
    "part_bytes missing": (_drop_part_bytes, "invalid part size"),
    "part_bytes zero": (_set("part_bytes", 0), "invalid part size"),
    "part_bytes one byte": (_set("part_bytes", 1), "invalid part size"),
    "part_bytes under a page": (_set("part_bytes", 4095), "invalid part size"),
    "part_bytes under 64 KiB": (_set("part_bytes", PART - 1), "invalid part size"),
    "part_bytes negative": (_set("part_bytes", -PART), "invalid part size"),
    "part_bytes a float": (_set("part_bytes", float(PART)), "invalid part size"),
    "part_bytes a bool": (_set("part_bytes", True), "invalid part size"),
    "part_bytes a string": (_set("part_bytes", str(PART)), "invalid part size"),
    "part_bytes doubled": (
        _set("part_bytes", 2 * PART),
        "lists 3 parts for tensor 'bf16', whose 196608 bytes make 2 of 131072",
    ),
    "a digest too many": (_one_digest_too_many, "lists 7 parts for tensor 'w'"),
    "a digest short": (_one_digest_short, "lists 5 parts for tensor 'w'"),
    "an empty list": (_empty_list, "checksum table is malformed"),
    "a short digest": (_short_digest, "checksum table is malformed"),
    "a number for a digest": (_number_digest, "checksum table is malformed"),
}


@pytest.mark.parametrize("crafted", list(CRAFTED), ids=list(CRAFTED))
def test_a_crafted_table_of_parts_is_a_corrupt_file_named(tmp_path, crafted):
    edit, message = CRAFTED[crafted]
    path = checkpoints.save_checkpoint(tmp_path, _state(), 1)
    _edit_table(path, edit)
    with pytest.raises(CheckpointFormatError, match=message) as caught:
        checkpoints.restore_checkpoint(path, None)
    assert str(path) in str(caught.value)


def test_a_part_size_on_a_file_without_parts_is_refused_when_invalid(tmp_path):
    path = checkpoints.save_checkpoint(tmp_path, {"a": np.arange(3.0)}, 1)
    _edit_table(path, _set("part_bytes", -1))
    with pytest.raises(CheckpointFormatError, match="invalid part size"):
        checkpoints.restore_checkpoint(path, None)


# ------------------------------------------------------------------ older and newer readers


def test_a_file_with_one_digest_per_tensor_still_verifies(tmp_path, monkeypatch):
    # As every eqx_train before version 3 wrote it: one xxh3 stream per tensor.
    monkeypatch.setattr(_checksums, "PART_BYTES", 1 << 62)
    state = _state()
    path = checkpoints.save_checkpoint(tmp_path, state, 1)
    assert _header(path)["__metadata__"][VERSION] == "2"  # complex128, no parts
    assert "part_bytes" not in _table(path)
    monkeypatch.setattr(_checksums, "PART_BYTES", PART)  # a reader that writes parts
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, _zeros(state)), state)
    start, _ = _span(path, "w")
    with open(path, "r+b") as file:
        file.seek(start + 3 * PART)
        file.write(b"\x00\x01")
    with pytest.raises(CheckpointFormatError, match="tensor 'w' fails its checksum"):
        checkpoints.restore_checkpoint(tmp_path, _zeros(state))


def test_a_reader_of_version_2_refuses_parts_as_newer_and_its_manager_keeps_it(
    tmp_path, monkeypatch
):
    state = {"w": jnp.arange(PART, dtype=jnp.float32)}
    checkpoints.save_checkpoint(tmp_path, state, 1)
    monkeypatch.setattr(_header_codes, "FORMAT_VERSION", 2)
    monkeypatch.setattr(_header_codes, "READABLE_VERSIONS", frozenset({"1", "2"}))
    with pytest.raises(NewerFormatError, match="newer eqx_train"):
        checkpoints.restore_checkpoint(tmp_path, None)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(NewerFormatError):
        checkpoints.CheckpointManager(tmp_path).restore(None)
    assert sorted(os.listdir(tmp_path)) == before


# ------------------------------------------------------------------ who verifies


def test_each_part_is_verified_by_the_reader_that_read_it(tmp_path, monkeypatch):
    _read_in_parts(monkeypatch)
    verified: list[tuple[str, int]] = []
    real = _part_reads.verify_part

    def recorded(info, index, view, bad, each=None):
        verified.append((threading.current_thread().name, index))
        return real(info, index, view, bad, each)

    monkeypatch.setattr(_part_reads, "verify_part", recorded)
    state = _state()
    checkpoints.save_checkpoint(tmp_path, state, 1)
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, _zeros(state)), state)
    # w's 6 parts and bf16's 3; c128, of two parts only, is read (and verified) whole.
    assert sorted(i for _, i in verified) == [0, 0, 1, 1, 2, 2, 3, 4, 5]
    assert {t for t, _ in verified} <= {f"eqx_train-read_{i}" for i in range(_part_reads.READERS)}


def test_an_object_store_checkpoint_is_written_and_verified_in_parts():
    url = f"memory://eqx-parts-{os.getpid()}/run"
    try:
        state = _state()
        path = checkpoints.save_checkpoint(url, state, 1)
        fs = fsspec.filesystem("memory")
        data = bytearray(fs.cat_file(path.split("://")[1]))
        header = json.loads(data[8 : 8 + struct.unpack("<Q", data[:8])[0]])
        assert header["__metadata__"][VERSION] == "3"
        assert len(json.loads(header["__metadata__"][CHECKSUMS])["tensors"]["w"]) == 6
        assert_trees_equal(checkpoints.restore_checkpoint(url, _zeros(state)), state)
        data[-100] ^= 0x01  # in the last tensor's bytes
        fs.pipe_file(path.split("://")[1], bytes(data))
        with pytest.raises(CheckpointFormatError, match="fails its checksum"):
            checkpoints.restore_checkpoint(url, None)
    finally:
        fsspec.filesystem("memory").rm(f"eqx-parts-{os.getpid()}", recursive=True)


def test_a_shards_checkpoint_writes_its_piece_files_in_parts(tmp_path):
    state = _state()
    checkpoints.save_checkpoint_multiprocess(tmp_path, state, 1)
    pieces = [
        os.path.join(root, name)
        for root, _, names in os.walk(latest_path(tmp_path))
        for name in names
        if name != "index.safetensors"
    ]
    assert any(_header(p)["__metadata__"][VERSION] == "3" for p in pieces)
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, _zeros(state)), state)
