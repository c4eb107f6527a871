"""Onto an accelerator, a tensor larger than a quarter of the restore's window (and checksummed
in parts, format version 3) is read as spans of its parts, each sent to the device and its
pinned block freed on its own, then joined on the device (`pipeline._pieces`): the next
spans are read while earlier ones transfer, where a tensor as large as the window used to
be read, sent, and only then followed by the next.

The arena is made for CPU devices here (the `arena` fixture); parts are 64 KiB, the window
1 MiB (so spans of at most 256 KiB, 4 parts) and the arena as large as the window.
"""

from __future__ import annotations

import _thread
import threading
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints import CheckpointFormatError
from eqx_train.checkpoints.format import _checksums
from eqx_train.checkpoints.format._reader import FileReader
from eqx_train.checkpoints.format._spans import Span
from eqx_train.checkpoints.pipeline import _pieces, _pinned, _read, _restore, _transfer, _window

pytestmark = pytest.mark.usefixtures("interruptible")

PART = 64 * 1024
WINDOW = 1 << 20


@pytest.fixture
def read_keys(monkeypatch) -> list[Any]:
    """Small parts; returns every key (a tensor's name, or a `Span`) `read_many` got."""
    monkeypatch.setattr(_checksums, "PART_BYTES", PART)
    keys: list[Any] = []
    read_many = FileReader.read_many

    def recorded(self, names, **kwargs):
        keys.extend(names)
        return read_many(self, names, **kwargs)

    monkeypatch.setattr(FileReader, "read_many", recorded)
    return keys


@pytest.fixture
def pieces(monkeypatch, arena, read_keys) -> list[Any]:
    """`read_keys`, with an arena as large as the window."""
    monkeypatch.setattr(_pinned, "ARENA_BYTES", WINDOW)
    return read_keys


def _spans(keys: list[Any], name: str) -> list[Span]:
    return [k for k in keys if isinstance(k, Span) and k.name == name]


def _arena_in_use() -> list[int]:
    return [a.in_use() for _, a in _pinned._arenas.values() if a is not None]


def _restore_into(path: Any, target: Any, **options: Any) -> Any:
    return checkpoints.restore_checkpoint(path, target, host_window_bytes=WINDOW, **options)


def _assert_same_leaf(restored: Any, expected: Any, like: Any) -> None:
    assert restored.dtype == expected.dtype and restored.shape == expected.shape
    assert np.asarray(restored).tobytes() == np.asarray(expected).tobytes()
    assert restored.sharding == like.sharding
    assert restored.committed == like.committed


VALUES = {
    "float32, 16 parts": lambda: jnp.arange(512 * 512, dtype=jnp.float32).reshape(512, 512),
    "bfloat16, a short last part": lambda: (
        jnp.linspace(-3, 3, 1000 * 333).reshape(1000, 333).astype(jnp.bfloat16)
    ),
    "complex64": lambda: jnp.arange(70_000, dtype=jnp.float32) * (1 - 2j),
    "int8, 3-d": lambda: (
        (jnp.arange(3 * 300 * 700) % 251 - 125).astype(jnp.int8).reshape(3, 300, 700)
    ),
    "bool": lambda: jnp.arange(600_001) % 3 == 0,
}


@pytest.mark.parametrize("make", VALUES.values(), ids=VALUES.keys())
def test_a_large_tensor_is_read_in_spans_and_restored_exactly(tmp_path, pieces, make):
    state = {"big": make(), "small": jnp.arange(10.0)}
    checkpoints.save_checkpoint(tmp_path, state, 0)
    target = jax.tree.map(jnp.zeros_like, state)
    restored = _restore_into(tmp_path, target)
    for name in state:
        _assert_same_leaf(restored[name], state[name], target[name])
    spans = _spans(pieces, "big")
    assert len(spans) >= 2 and "small" in pieces and "big" not in pieces
    assert sum(s.nbytes for s in spans) == state["big"].nbytes
    assert max(s.nbytes for s in spans) <= WINDOW // 4
    assert _arena_in_use() == [0]


class _Model(eqx.Module):
    embedding: eqx.nn.Embedding
    norm: eqx.nn.BatchNorm
    dropout: eqx.nn.Dropout
    head: jax.Array
    scale: float = eqx.field(static=True)


def test_an_equinox_model_with_state_keys_and_a_large_embedding_restores_in_spans(tmp_path, pieces):
    keys = jax.random.split(jax.random.key(0), 3)
    norm, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(8, "batch", mode="batch")
    model = _Model(
        eqx.nn.Embedding(1000, 300, key=keys[0]),  # 1.2 MB: read in spans
        norm,
        eqx.nn.Dropout(0.1),
        (jax.random.normal(keys[1], (300, 300)) * (1 + 1j)).astype(jnp.complex64),
        scale=0.5,
    )
    tree = {"model": model, "state": state, "key": keys[2], "bf16": jnp.ones(9, jnp.bfloat16)}
    checkpoints.save_checkpoint(tmp_path, tree, 0)
    target = jax.tree.map(lambda x: jnp.zeros_like(x) if eqx.is_inexact_array(x) else x, tree)
    restored = _restore_into(tmp_path, target)
    assert bool(eqx.tree_equal(restored, tree))
    spanned = {s.name for s in pieces if isinstance(s, Span)}
    assert len(spanned) == 2 and all("embedding" in n or "head" in n for n in spanned)


def _targets() -> dict[str, Any]:
    devices = jax.devices()
    return {
        "uncommitted": jnp.zeros((512, 512)),
        "uncommitted on device 5": jax.device_put(jnp.zeros((512, 512))),
        "committed to device 3": jax.device_put(jnp.zeros((512, 512)), devices[3]),
        "struct on device 2": jax.ShapeDtypeStruct(
            (512, 512), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(devices[2])
        ),
        "struct without a sharding": jax.ShapeDtypeStruct((512, 512), jnp.float32),
        "weakly typed": jnp.broadcast_to(jnp.asarray(0.0), (512, 512)),
    }


def test_a_leaf_read_in_spans_is_placed_exactly_as_one_read_whole(tmp_path, pieces, monkeypatch):
    """Same values, sharding, committedness and weak type as the same restore reading each
    tensor whole (spans turned off)."""
    value = jax.random.normal(jax.random.key(0), (512, 512))
    state = {name: value for name in _targets()}
    checkpoints.save_checkpoint(tmp_path, state, 0)
    with jax.default_device(jax.devices()[5]):
        targets = _targets()
    in_pieces = _restore_into(tmp_path, targets)
    assert {s.name for s in pieces if isinstance(s, Span)} == set(state)
    monkeypatch.setattr(FileReader, "spans", lambda self, name, max_bytes: None)
    pieces.clear()
    whole = _restore_into(tmp_path, targets)
    assert not any(isinstance(k, Span) for k in pieces)
    for name in state:
        a, b = in_pieces[name], whole[name]
        assert np.array_equal(np.asarray(a), np.asarray(value)), name
        assert (a.sharding, a.committed, a.weak_type) == (b.sharding, b.committed, b.weak_type)
    assert in_pieces["weakly typed"].weak_type
    assert in_pieces["committed to device 3"].committed
    assert not in_pieces["uncommitted on device 5"].committed


def test_the_join_of_a_tensor_shape_is_compiled_before_its_spans_are_read(
    tmp_path, pieces, monkeypatch
):
    """Compiled ahead, on a thread of its own, from the restore's start: the join that runs
    once the last span is in finds it compiled (no compilation of its own)."""
    monkeypatch.setattr(_pieces._Join, "_made", {})
    events: list[str] = []
    read_many, of = FileReader.read_many, _pieces._Join.of.__func__

    def joining(cls, *args):
        events.append("join made")
        return of(cls, *args)

    def reading(self, names, **kwargs):
        events.append("read")
        return read_many(self, names, **kwargs)

    monkeypatch.setattr(_pieces._Join, "of", classmethod(joining))
    monkeypatch.setattr(FileReader, "read_many", reading)
    value = jax.random.normal(jax.random.key(1), (256, 1000))  # a shape no other test joins
    checkpoints.save_checkpoint(tmp_path, {"w": value}, 0)
    compiled = _pieces._joiner()._cache_size()
    restored = _restore_into(tmp_path, {"w": jnp.zeros_like(value)})
    assert np.array_equal(np.asarray(restored["w"]), np.asarray(value))
    assert events[0] == "join made" and events.count("join made") == 1
    (join,) = _pieces._Join._made.values()
    assert join.compiled.is_set()
    assert _pieces._joiner()._cache_size() == compiled + 1  # the one compiled ahead
    _restore_into(tmp_path, {"w": jnp.zeros_like(value)})
    assert len(_pieces._Join._made) == 1  # once per kind of tensor in a process


MESHES = {
    "jax.set_mesh": lambda mesh: jax.set_mesh(mesh),
    "use_abstract_mesh": lambda mesh: jax.sharding.use_abstract_mesh(mesh.abstract_mesh),
}


@pytest.mark.parametrize("context", MESHES.values(), ids=MESHES.keys())
def test_a_mesh_the_caller_set_does_not_move_a_leaf_read_in_spans(
    tmp_path, pieces, monkeypatch, context
):
    """The pieces are joined on the leaf's own device: under a mesh of every device, the
    join would otherwise follow the mesh (onto all of them) or fail to lower."""
    value = jnp.arange(WINDOW // 4, dtype=jnp.float32)
    checkpoints.save_checkpoint(tmp_path, {"u": value, "c": value}, 0)
    target = {"u": jnp.zeros_like(value), "c": jax.device_put(value * 0, jax.devices()[3])}
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    with context(mesh):
        in_spans = _restore_into(tmp_path, target)
    assert len(_spans(pieces, "u")) == 4
    monkeypatch.setattr(FileReader, "spans", lambda self, name, max_bytes: None)
    with context(mesh):
        whole = _restore_into(tmp_path, target)
    for name in target:
        a, b = in_spans[name], whole[name]
        assert np.array_equal(np.asarray(a), np.asarray(value))
        assert (
            (a.sharding, a.committed)
            == (b.sharding, b.committed)
            == (
                target[name].sharding,
                target[name].committed,
            )
        )


def test_a_window_larger_than_the_arena_makes_spans_the_arena_holds(tmp_path, pieces, monkeypatch):
    """Spans of a quarter of the window would each miss the arena, and be sent from pageable
    memory: they take a quarter of the arena instead. (A window larger than the arena keeps
    more bytes in flight than it holds: those past it are read into buffers of their own,
    as whole tensors are.)"""
    monkeypatch.setattr(_pinned, "ARENA_BYTES", WINDOW // 2)
    handed: list[bool] = []
    allocate = _pinned.Arena.allocate
    monkeypatch.setattr(
        _pinned.Arena,
        "allocate",
        lambda self, *a: handed.append((block := allocate(self, *a)) is not None) or block,
    )
    value = jnp.arange(WINDOW // 4, dtype=jnp.float32)
    checkpoints.save_checkpoint(tmp_path, {"w": value}, 0)
    restored = checkpoints.restore_checkpoint(
        tmp_path, {"w": jnp.zeros_like(value)}, host_window_bytes=4 * WINDOW
    )
    assert np.array_equal(np.asarray(restored["w"]), np.asarray(value))
    assert {s.nbytes for s in _spans(pieces, "w")} == {WINDOW // 8}
    assert handed[:4] == [True] * 4


def test_a_tensor_the_device_has_no_room_to_join_is_read_whole(tmp_path, pieces, monkeypatch):
    monkeypatch.setattr(_pieces._Room, "to_join", lambda self, device, nbytes: False)
    _round_trip_of_one_leaf(tmp_path)
    assert pieces == ["w"]


def test_a_part_larger_than_a_quarter_of_the_arena_makes_no_spans(tmp_path, pieces, monkeypatch):
    """A span of one such part could not come from the arena: the tensor would be held
    twice on the device for nothing."""
    monkeypatch.setattr(_pinned, "ARENA_BYTES", 3 * PART)
    _round_trip_of_one_leaf(tmp_path)
    assert pieces == ["w"]


class _Device:
    def __init__(self, stats: Any) -> None:
        self.stats = stats

    def memory_stats(self) -> Any:
        if isinstance(self.stats, Exception):
            raise self.stats
        return self.stats


@pytest.mark.parametrize(
    "stats, room",
    [
        ({"bytes_limit": 1000, "bytes_in_use": 800}, True),  # 200 free: twice 100
        ({"bytes_limit": 1000, "bytes_in_use": 801}, False),
        (None, True),  # no statistics (a CPU): as it was
        ({}, True),
        (NotImplementedError("no stats"), True),
    ],
)
def test_room_to_join_is_twice_the_tensor_where_the_device_says(stats, room):
    assert _pieces._Room().to_join(_Device(stats), 100) is room


def test_room_to_join_counts_what_the_restore_places_before():
    """A state that fits the device read whole must fit it in spans: the tensors placed
    before one count against its room, on their own device only."""
    device, other = _Device({"bytes_limit": 1000, "bytes_in_use": 0}), _Device(None)
    room = _pieces._Room()
    assert room.to_join(device, 500)
    room.placed(device, 500)
    room.placed(other, 10**9)
    assert room.to_join(device, 250)
    room.placed(device, 250)
    assert not room.to_join(device, 200)  # 250 free, 400 needed
    assert room.to_join(other, 10**12)


def test_a_restore_that_would_fill_the_device_reads_its_last_tensors_whole(
    tmp_path, pieces, monkeypatch
):
    """Three tensors of 1 MiB on a device with 3.5 MiB free: the first two fit twice
    beside what comes before them, the third (1.5 MiB left, 2 needed) does not."""
    monkeypatch.setattr(_pieces, "_free_bytes", lambda device: 7 * WINDOW // 2)
    state = {f"w{i}": jnp.full(WINDOW // 4, i, jnp.float32) for i in range(3)}
    checkpoints.save_checkpoint(tmp_path, state, 0)
    restored = _restore_into(tmp_path, jax.tree.map(jnp.zeros_like, state))
    for name in state:
        assert np.array_equal(np.asarray(restored[name]), np.asarray(state[name]))
    assert [bool(_spans(pieces, n)) for n in state] == [True, True, False]
    assert "w2" in pieces


@pytest.mark.parametrize("in_spans", [True, False], ids=["in spans", "whole (planted)"])
def test_the_next_tensor_is_read_while_the_last_spans_of_one_still_transfer(
    tmp_path, pieces, monkeypatch, in_spans
):
    """Two tensors each as large as the window (and the arena): the first span of `b` must be
    read before the transfer of `a`'s last span is waited for. Read whole (the planted
    bug: spans off), `b` waits for all of `a`, and the wait below times out."""
    if not in_spans:
        monkeypatch.setattr(FileReader, "spans", lambda self, name, max_bytes: None)
    state = {
        "a": jnp.arange(WINDOW // 4, dtype=jnp.float32),
        "b": -jnp.arange(WINDOW // 4, dtype=jnp.float32),
    }
    checkpoints.save_checkpoint(tmp_path, state, 0)
    b_read = threading.Event()
    read_many = FileReader.read_many

    def reading(self, names, **kwargs):
        if any(n == "b" or isinstance(n, Span) and n.name == "b" for n in names):
            b_read.set()
        return read_many(self, names, **kwargs)

    monkeypatch.setattr(FileReader, "read_many", reading)
    settle = _restore.settle_placed
    settled: list[Any] = []
    overlapped: list[bool] = []

    def settling(placed):
        settled.append(placed)
        if len(settled) == (4 if in_spans else 1):  # `a`'s last span, or all of `a`
            overlapped.append(b_read.wait(timeout=10 if in_spans else 1))
        settle(placed)

    monkeypatch.setattr(_restore, "settle_placed", settling)
    restored = _restore_into(tmp_path, jax.tree.map(jnp.zeros_like, state))
    for name in state:
        assert np.array_equal(np.asarray(restored[name]), np.asarray(state[name]))
    assert len(_spans(pieces, "a")) == (4 if in_spans else 0)
    assert overlapped == [in_spans]


@pytest.mark.parametrize("check_while_placing", [True, False])
def test_a_corrupt_part_of_a_span_fails_naming_its_part_and_frees_every_block(
    tmp_path, pieces, monkeypatch, check_while_placing
):
    monkeypatch.setattr(_read, "CHECK_WHILE_PLACING", check_while_placing)
    state = {"w": jnp.arange(WINDOW // 2, dtype=jnp.float32), "b": jnp.ones(3)}  # 32 parts
    path = checkpoints.save_checkpoint(tmp_path, state, 0)
    with FileReader(str(path)) as reader:
        start = reader.tensors["w"].start
    with open(path, "r+b") as file:
        file.seek(start + 9 * PART + 11)  # in the third span
        file.write(b"\x7f")
    before = _window.held_bytes()
    with pytest.raises(CheckpointFormatError, match="tensor 'w' fails its checksum in its part 9 "):
        _restore_into(tmp_path, jax.tree.map(jnp.zeros_like, state))
    assert _spans(pieces, "w")
    assert _arena_in_use() == [0]
    assert _window.held_bytes() == before


def test_an_interrupted_restore_in_spans_frees_every_block_and_restores_again(
    tmp_path, pieces, monkeypatch
):
    state = {f"w{i}": jnp.full(WINDOW // 4, i, jnp.float32) for i in range(3)}
    checkpoints.save_checkpoint(tmp_path, state, 0)
    taken = []

    def interrupt_at_the_fifth_group():
        taken.append(None)
        if len(taken) == 5:  # mid-tensor: `w1`'s first span
            _thread.interrupt_main()

    monkeypatch.setattr(_transfer, "group_taken", interrupt_at_the_fifth_group)
    before = _window.held_bytes()
    with pytest.raises(KeyboardInterrupt):
        _restore_into(tmp_path, jax.tree.map(jnp.zeros_like, state))
    assert len(taken) == 5
    assert _arena_in_use() == [0]
    assert _window.held_bytes() == before
    monkeypatch.setattr(_transfer, "group_taken", lambda: None)
    restored = _restore_into(tmp_path, jax.tree.map(jnp.zeros_like, state))
    for name in state:
        assert np.array_equal(np.asarray(restored[name]), np.asarray(state[name]))


def test_an_unverified_restore_reads_in_spans_too(tmp_path, pieces):
    state = {"w": jnp.arange(WINDOW // 4, dtype=jnp.float32)}
    checkpoints.save_checkpoint(tmp_path, state, 0)
    restored = _restore_into(tmp_path, jax.tree.map(jnp.zeros_like, state), verify=False)
    assert np.array_equal(np.asarray(restored["w"]), np.asarray(state["w"]))
    assert len(_spans(pieces, "w")) == 4


def test_progress_counts_each_span_once(tmp_path, pieces):
    state = {"w": jnp.arange(WINDOW // 4 + 5, dtype=jnp.float32), "b": jnp.ones(7)}
    checkpoints.save_checkpoint(tmp_path, state, 0)
    seen: list[tuple[int, int]] = []
    _restore_into(
        tmp_path, jax.tree.map(jnp.zeros_like, state), progress=lambda d, t: seen.append((d, t))
    )
    total = state["w"].nbytes + state["b"].nbytes
    assert len(_spans(pieces, "w")) == 5
    assert seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def _sharded_over_two() -> Any:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    return jax.device_put(jnp.zeros(WINDOW // 4), sharding)


NOT_IN_SPANS = {
    "a leaf sharded over two devices": (_sharded_over_two, {}),
    "a NumPy leaf": (lambda: np.zeros(WINDOW // 4, np.float32), {}),
    "a leaf in pinned host memory": (
        lambda: jax.device_put(
            jnp.zeros(WINDOW // 4),
            jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"),
        ),
        {},
    ),
    "a leaf cast from the saved dtype": (
        lambda: jnp.zeros(WINDOW // 4, jnp.bfloat16),
        {"casting": "same_kind"},
    ),
}


@pytest.mark.parametrize("target, options", NOT_IN_SPANS.values(), ids=NOT_IN_SPANS.keys())
def test_leaves_pieces_cannot_place_are_read_whole(tmp_path, pieces, target, options):
    value = jnp.arange(WINDOW // 4, dtype=jnp.float32)
    checkpoints.save_checkpoint(tmp_path, {"w": value}, 0)
    target = target()
    restored = _restore_into(tmp_path, {"w": target}, **options)["w"]
    assert np.array_equal(np.asarray(restored), np.asarray(value).astype(target.dtype))
    assert pieces == ["w"]


def _round_trip_of_one_leaf(path: Any) -> None:
    value = jnp.arange(WINDOW // 4, dtype=jnp.float32)
    checkpoints.save_checkpoint(path, {"w": value}, 0)
    restored = _restore_into(path, {"w": jnp.zeros_like(value)})
    assert np.array_equal(np.asarray(restored["w"]), np.asarray(value))


def test_a_file_with_one_digest_per_tensor_is_read_whole(tmp_path, pieces, monkeypatch):
    monkeypatch.setattr(_checksums, "PART_BYTES", 1 << 62)  # as written before format 3
    _round_trip_of_one_leaf(tmp_path)
    assert pieces == ["w"]


def test_without_an_arena_nothing_is_read_in_spans(tmp_path, read_keys):
    """A CPU device adopts host buffers: it has no arena, and no reason for pieces."""
    _round_trip_of_one_leaf(tmp_path)
    assert read_keys == ["w"]


# ------------------------------------------------------------------------------ the reader


def test_spans_cover_a_tensor_in_whole_parts_of_at_most_the_bytes_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(_checksums, "PART_BYTES", PART)
    path = checkpoints.save_checkpoint(
        tmp_path, {"w": np.arange(10 * PART // 4 + 3, dtype=np.float32), "s": np.ones(4)}, 0
    )
    with FileReader(str(path)) as reader:
        spans = reader.spans("w", 4 * PART + 100)
        assert spans == [
            Span("w", 0, 4, 4 * PART),
            Span("w", 4, 8, 4 * PART),
            Span("w", 8, 11, 2 * PART + 12),
        ]
        assert reader.spans("w", 11 * PART) is None  # one span: read whole
        assert reader.spans("s", PART) is None  # one digest: no parts
        assert len(reader.spans("w", 100) or []) == 11  # at least one part each
        arrays = reader.read_many(spans)
        joined = np.concatenate([arrays[s] for s in spans])
        assert np.array_equal(joined, reader.read("w"))
        reader.verify_read(arrays)


def test_a_part_size_that_splits_elements_makes_spans_of_whole_elements(tmp_path, monkeypatch):
    monkeypatch.setattr(_checksums, "PART_BYTES", PART + 1)  # odd: 4 parts end on a float32
    value = np.arange(12 * PART // 4, dtype=np.float32)
    path = checkpoints.save_checkpoint(tmp_path, {"w": value}, 0)
    with FileReader(str(path)) as reader:
        spans = reader.spans("w", 6 * (PART + 1))
        assert spans is not None and [s.stop - s.first for s in spans] == [4, 4, 4]
        arrays = reader.read_many(spans)
        assert np.array_equal(np.concatenate([arrays[s] for s in spans]), value)


@pytest.mark.parametrize(
    "span, why",
    [
        (Span("w", 0, 99, 4 * PART), "not a span of the tensor.s parts"),
        (Span("w", 3, 3, 0), "not a span of the tensor.s parts"),
        (Span("s", 0, 1, 32), "not a span of the tensor.s parts"),
        (Span("w", 0, 4, 4 * PART + 4), "not 262148 bytes"),
    ],
)
def test_a_span_that_is_not_one_of_the_tensor_is_refused_by_name(tmp_path, monkeypatch, span, why):
    monkeypatch.setattr(_checksums, "PART_BYTES", PART)
    path = checkpoints.save_checkpoint(
        tmp_path, {"w": np.arange(10 * PART // 4, dtype=np.float32), "s": np.ones(4)}, 0
    )
    with FileReader(str(path)) as reader, pytest.raises(ValueError, match=why) as caught:
        reader.read_many([span])
    assert f"tensor '{span.name}' (its parts" in str(caught.value)


def test_bfloat16_spans_keep_their_dtype(tmp_path, monkeypatch):
    monkeypatch.setattr(_checksums, "PART_BYTES", PART)
    value = np.linspace(-1, 1, 3 * PART, dtype=np.float32).astype(ml_dtypes.bfloat16)
    path = checkpoints.save_checkpoint(tmp_path, {"w": value}, 0)
    with FileReader(str(path)) as reader:
        spans = reader.spans("w", 2 * PART) or []
        arrays = reader.read_many(spans, parallel=False)
        assert {a.dtype for a in arrays.values()} == {np.dtype(ml_dtypes.bfloat16)}
        assert np.concatenate([arrays[s] for s in spans]).tobytes() == value.tobytes()
