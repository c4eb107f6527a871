"""A restore places leaves from background threads and a save lays out the file for pages:
neither may change what a restore returns, where it puts it, what it holds, or which files
other tools (and older eqx_train files) can read.

The threads that place leaves are not the caller's: JAX's thread-local settings (x64, the
default device, the mesh of `jax.set_mesh`) must still be the caller's, an interrupt that
lands while they start must not leave them behind, and tied leaves must not share memory.
"""

import _thread
import json
import os
import threading
import time
import types
from typing import Any

import equinox as eqx
import fsspec
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from jax.sharding import NamedSharding, PartitionSpec as P

from eqx_train.checkpoints import restore_checkpoint, save_checkpoint
from eqx_train.checkpoints.format import _description, _format
from eqx_train.checkpoints.pipeline import _restore, _transfer, _window
from tests.support.helpers import assert_trees_equal, main_thread_is_in

# Every interrupt below is delivered as SIGINT, which must raise however the suite started.
pytestmark = pytest.mark.usefixtures("interruptible")

LEAF = 64 << 10  # bytes of each leaf of `_leaves`


def _leaves(count=8):
    return {f"l{i}": jnp.full(LEAF // 4, i, jnp.float32) for i in range(count)}


def _restore_threads():
    return [t for t in threading.enumerate() if t.name.startswith("eqx_train-restore-read")]


# ------------------------------------------------------------------ the caller's JAX settings


def test_float64_leaves_restored_inside_enable_x64_stay_float64(tmp_path):
    thirds = np.arange(8, dtype=np.float64) / 3  # not exact in float32
    with jax.enable_x64(True):
        save_checkpoint(tmp_path, {"w": thirds, "s": thirds[:3]}, 1)
        target = {
            "w": jnp.zeros(8, jnp.float64),
            "s": jax.ShapeDtypeStruct((3,), jnp.float64),
        }
        restored = restore_checkpoint(tmp_path, target, host_window_bytes=64)
        assert restored["w"].dtype == restored["s"].dtype == np.float64
        np.testing.assert_array_equal(np.asarray(restored["w"]), thirds)
        np.testing.assert_array_equal(np.asarray(restored["s"]), thirds[:3])


def test_unsharded_abstract_leaves_land_on_the_callers_default_device(tmp_path):
    save_checkpoint(tmp_path, _leaves(4), 1)
    target = {name: jax.ShapeDtypeStruct(v.shape, v.dtype) for name, v in _leaves(4).items()}
    device = jax.devices()[3]
    with jax.default_device(device):
        restored: Any = restore_checkpoint(tmp_path, target, host_window_bytes=LEAF)  # arrays
    assert {name: leaf.devices() for name, leaf in restored.items()} == {
        name: {device} for name in target
    }


def test_abstract_leaves_sharded_by_a_partition_spec_use_the_callers_mesh(tmp_path):
    values = np.arange(64, dtype=np.float32).reshape(8, 8)
    save_checkpoint(tmp_path, {"w": values, "v": values[0]}, 1)
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=explicit)
    with jax.set_mesh(mesh):
        target = {
            "w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=P("a", "b")),
            "v": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=P("a")),
        }
        restored = restore_checkpoint(tmp_path, target, host_window_bytes=64)
    assert restored["w"].sharding == NamedSharding(mesh, P("a", "b"))
    assert restored["v"].sharding == NamedSharding(mesh, P("a"))
    np.testing.assert_array_equal(np.asarray(restored["w"]), values)


# ------------------------------------------------------------------ errors and interrupts


@pytest.mark.parametrize("error", [TypeError, MemoryError])
def test_an_error_other_than_valueerror_while_placing_keeps_its_type_and_frees_the_window(
    tmp_path, monkeypatch, error
):
    save_checkpoint(tmp_path, _leaves(), 1)
    real = _restore.place

    def place(kind, target, array):
        if array[0] == 5:
            raise error("the sixth leaf cannot be placed")
        return real(kind, target, array)

    monkeypatch.setattr(_restore, "place", place)
    before = _window.held_bytes()
    with pytest.raises(error, match="the sixth leaf"):
        restore_checkpoint(tmp_path, _leaves(), host_window_bytes=4 * LEAF)
    assert _window.held_bytes() == before
    assert not _restore_threads()


def test_a_failed_restore_ends_while_a_later_group_still_waits_for_a_thread(monkeypatch):
    # One placing thread: group b runs on it while group c waits in its queue, and the
    # restore fails (settling group a). The end shuts the pool down, which cancels c: c
    # never runs, so the end must wait for b only (a future cancelled in a pool's queue
    # never counts as done to `concurrent.futures.wait`: the end would wait forever).
    futures: list[Any] = []
    all_submitted = threading.Event()

    class OneThread(_transfer.ThreadPoolExecutor):
        def __init__(self, *args, **kwargs):
            super().__init__(1, thread_name_prefix="eqx_train-restore-read")

        def submit(self, *args, **kwargs):
            futures.append(super().submit(*args, **kwargs))
            if len(futures) == 3:
                all_submitted.set()
            return futures[-1]

    monkeypatch.setattr(_transfer, "ThreadPoolExecutor", OneThread)
    ran: list[str] = []

    def read_many(group):
        ran.extend(group)
        if group == ["b"]:  # busy until c is cancelled in the queue
            deadline = time.monotonic() + 10
            while not futures[2].cancelled() and time.monotonic() < deadline:
                time.sleep(0.001)
        return {name: np.zeros(1) for name in group}

    def settle(group):
        assert all_submitted.wait(10)
        deadline = time.monotonic() + 10
        while "b" not in ran and time.monotonic() < deadline:  # b on the thread, c queued
            time.sleep(0.001)
        raise RuntimeError("settling failed")

    reads = _transfer.windowed_reads(
        ["a", "b", "c"],
        lambda name: 20,  # a group each (at most a quarter of the window), all in it at once
        read_many,
        _window.HostWindow(100),
        settle=settle,
        place=lambda name, array: array,
    )
    outcome: list[BaseException] = []

    def consume():
        try:
            list(reads)
        except RuntimeError as error:
            outcome.append(error)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    consumer.join(30)
    assert not consumer.is_alive(), "the restore's end waits for a group that never runs"
    assert [str(e) for e in outcome] == ["settling failed"]
    assert ran == ["a", "b"] and futures[2].cancelled()


@pytest.mark.parametrize("started", [True, False], ids=["after_start", "before_start"])
def test_an_interrupt_while_the_reader_thread_starts_frees_the_window_and_the_threads(
    tmp_path, monkeypatch, started
):
    save_checkpoint(tmp_path, _leaves(), 1)
    placing = threading.Event()
    real = _restore.place

    def place(kind, target, array):
        placing.set()
        return real(kind, target, array)

    class InterruptedWhileStarting(threading.Thread):
        """A thread whose `start` is interrupted (as by Ctrl-C): once the thread already
        reads and places, or before it runs at all."""

        def start(self):
            if started:
                super().start()
                assert placing.wait(30)  # the reader already holds window bytes
            raise KeyboardInterrupt

    monkeypatch.setattr(_restore, "place", place)
    monkeypatch.setattr(
        _transfer, "threading", types.SimpleNamespace(Thread=InterruptedWhileStarting)
    )
    before = _window.held_bytes()
    with pytest.raises(KeyboardInterrupt):
        restore_checkpoint(tmp_path, _leaves(), host_window_bytes=LEAF)
    assert _window.held_bytes() == before
    for thread in _restore_threads():  # one that never got going ends on its own
        thread.join(30)
    assert not _restore_threads()


def test_an_interrupt_from_a_placing_thread_leaves_nothing_behind(tmp_path, monkeypatch):
    # The interrupt lands in the caller's thread wherever it is at that moment.
    save_checkpoint(tmp_path, _leaves(), 1)
    real, placed = _restore.place, []

    def place(kind, target, array):
        placed.append(None)
        if len(placed) == 3:
            _thread.interrupt_main()
        return real(kind, target, array)

    monkeypatch.setattr(_restore, "place", place)
    before = _window.held_bytes()
    with pytest.raises(KeyboardInterrupt):
        restore_checkpoint(tmp_path, _leaves(), host_window_bytes=2 * LEAF)
        while True:  # a restore that returned first is interrupted here instead
            pass
    assert _window.held_bytes() == before
    assert not _restore_threads()


def test_a_second_interrupt_while_a_failed_restore_cleans_up_still_frees_its_window(
    tmp_path, monkeypatch
):
    save_checkpoint(tmp_path, _leaves(), 1)
    second_placing = threading.Event()
    real = _restore.place

    def place(kind, target, array):
        if array[0] == 0:
            assert second_placing.wait(30)
            raise TypeError("the first leaf cannot be placed")
        if array[0] == 1:
            second_placing.set()
            deadline = time.monotonic() + 30
            while not main_thread_is_in("wait_through_interrupts") and time.monotonic() < deadline:
                time.sleep(0.001)  # until the caller waits for this thread to finish
            _thread.interrupt_main()
        return real(kind, target, array)

    monkeypatch.setattr(_restore, "place", place)
    before = _window.held_bytes()
    with pytest.raises(KeyboardInterrupt):
        restore_checkpoint(tmp_path, _leaves(), host_window_bytes=4 * LEAF)
    assert _window.held_bytes() == before
    for thread in _restore_threads():  # they end on their own once the window is cancelled
        thread.join(30)
    assert not _restore_threads()


def test_python_scalars_the_file_cannot_fill_are_all_named_in_tree_order(tmp_path):
    saved = {f"s{i}": i + 0.5 for i in range(12)}
    save_checkpoint(tmp_path, saved, 1)
    target = {f"s{i}": 0 for i in range(12)}  # ints: 0.5, 1.5, ... do not convert exactly
    messages = set()
    for _ in range(3):
        with pytest.raises(ValueError) as raised:
            restore_checkpoint(tmp_path, target, host_window_bytes=32)
        messages.add(str(raised.value))
    (message,) = messages  # the same message every time
    named = [message.index(f"'{name}'") for name in sorted(target)]  # JAX's order: s0, s1, s10
    assert named == sorted(named)


# ------------------------------------------------------------------ tied leaves


def test_a_numpy_leaf_tied_to_a_jax_leaf_does_not_share_its_memory(tmp_path):
    save_checkpoint(tmp_path, {"w": np.arange(16, dtype=np.float32)}, 1)
    target = {
        "a": np.zeros(16, np.float32),
        "b": jnp.zeros(16, jnp.float32),
        "c": np.zeros(16, np.float32),
    }
    restored = restore_checkpoint(
        tmp_path, target, rename={"a": "w", "b": "w", "c": "w"}, strict=False
    )
    restored["a"][:] = -1
    restored["c"][:] = -2
    np.testing.assert_array_equal(np.asarray(restored["b"]), np.arange(16, dtype=np.float32))
    np.testing.assert_array_equal(restored["c"], np.full(16, -2, np.float32))


# ------------------------------------------------------------------ every kind of leaf


class _Layer(eqx.Module):
    weight: jax.Array
    activation: str = eqx.field(static=True)


def _everything():
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    norm, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, "batch", mode="batch")
    return {
        "key": jax.random.key(3),
        "keys": jax.random.split(jax.random.key(4, impl="rbg"), 3),
        "bf16": jnp.linspace(0, 1, 40, dtype=jnp.bfloat16),
        "weak": jnp.asarray(1.5),
        "norm": norm,
        "state": state,
        "layer": _Layer(jnp.ones(3), "relu"),
        "numpy": np.arange(6, dtype=np.int16).reshape(2, 3),
        "python": {"i": 3, "f": 2.5, "b": True},
        "numpy_scalar": np.float32(4.0),
        "sharded": jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("a", "b"))),
        "replicated": jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P())),
        "empty": jnp.zeros((0, 3)),
    }


def test_every_kind_of_leaf_placed_by_several_threads_is_the_same_to_jitted_code(tmp_path):
    tree = _everything()
    save_checkpoint(tmp_path, tree, 1)
    restored = restore_checkpoint(tmp_path, _everything(), host_window_bytes=256)

    def kinds(tree):
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return [
            (jax.tree_util.keystr(path), type(x), getattr(x, "dtype", None))
            + (
                (x.shape, getattr(x, "weak_type", None), x.sharding)
                if isinstance(x, jax.Array)
                else ()
            )
            for path, x in leaves
        ]

    assert_trees_equal(restored, tree)
    assert kinds(restored) == kinds(tree)


def test_casts_allowed_by_casting_still_happen_on_the_host(tmp_path):
    save_checkpoint(tmp_path, {"f": np.arange(4, dtype=np.float32) + 0.5, "i": np.arange(4)}, 1)
    target = {"f": jnp.zeros(4, jnp.bfloat16), "i": np.zeros(4, np.uint8)}
    restored = restore_checkpoint(tmp_path, target, casting="unsafe", host_window_bytes=8)
    assert restored["f"].dtype == jnp.bfloat16 and restored["i"].dtype == np.uint8
    np.testing.assert_array_equal(np.asarray(restored["f"], np.float32), [0.5, 1.5, 2.5, 3.5])
    np.testing.assert_array_equal(restored["i"], [0, 1, 2, 3])


# ------------------------------------------------------------------ the file's layout


def _sections(path):
    """(where the data section starts, [(begin, end, name)] sorted, file size)."""
    with open(path, "rb") as f:
        raw = f.read()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    spans = sorted((*v["data_offsets"], k) for k, v in header.items() if k != "__metadata__")
    return 8 + length, spans, len(raw)


_PAGE, _SMALL = 4096, 64
_TREES = {  # name: (tree, where its data section starts: on a page, or on 64 bytes)
    "scalars_only": ({"step": np.int32(3), "lr": 0.1, "n": 5, "half": np.float16(1)}, _SMALL),
    "zero_size": (
        {"e": np.zeros((0, 5), np.float32), "f": np.zeros((3, 0), np.int8), "s": 1},
        _SMALL,
    ),
    "a_byte_short_of_a_mebibyte": (
        {"w": np.ones((1 << 20) - 5, np.uint8), "step": np.int32(1)},
        _SMALL,
    ),
    "exactly_a_mebibyte": (
        {"w": np.ones((1 << 20) // 4 - 1, np.float32), "step": np.int32(1)},
        _PAGE,
    ),
    "non_ascii": (
        {"café": np.ones(100), "ключ": {"名前": np.arange(5)}, "note": "ünï 😀\u2028"},
        _SMALL,
    ),
}


@pytest.mark.parametrize("name", list(_TREES))
def test_the_tensors_tile_the_data_section_from_its_aligned_start(tmp_path, name):
    tree, alignment = _TREES[name]
    path = save_checkpoint(tmp_path, tree, 1)
    data_start, spans, size = _sections(path)
    ends = [0] + [end for _, end, _ in spans]
    assert [begin for begin, _, _ in spans] == ends[:-1]  # no gaps, no overlaps
    assert data_start + ends[-1] == size
    with open(path, "rb") as f:
        unpadded = 8 + len(f.read(data_start)[8:].rstrip(b" "))
    assert data_start % alignment == 0 and data_start - unpadded < alignment
    # Other tools read it, and see the values saved.
    arrays = [leaf for leaf in jax.tree.leaves(tree) if not isinstance(leaf, str)]
    loaded = safetensors.numpy.load_file(path)
    with safetensors.safe_open(path, "np") as f:
        assert sorted(f.keys()) == sorted(loaded)
    assert sorted(np.asarray(a).tobytes() for a in arrays) == sorted(
        v.tobytes() for v in loaded.values()
    )
    assert_trees_equal(restore_checkpoint(tmp_path, tree), tree)


def test_an_object_store_upload_has_the_same_bytes_as_a_local_file(tmp_path):
    tree = {"step": np.int32(7), "w": np.ones((1 << 20) // 4, np.float32), "b": np.ones(3)}
    local = save_checkpoint(tmp_path, tree, 1)
    remote = save_checkpoint(f"memory://review4-{tmp_path.name}", tree, 1)
    with fsspec.open(remote, "rb") as f, open(local, "rb") as g:
        # fsspec's stubs type OpenFile's context as its list form
        assert f.read() == g.read()  # pyright: ignore[reportAttributeAccessIssue]


def _rewrite_in_the_old_layout(path):
    """The file as eqx_train wrote it before pages: the header padded to 8 bytes (and here
    never to 64) and the tensors' bytes in the header's (tree) order."""
    with open(path, "rb") as f:
        raw = f.read()
    length = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8 : 8 + length]), raw[8 + length :]
    old, blobs, offset = {}, [], 0
    for name, entry in header.items():
        if name == "__metadata__":
            old[name] = entry
            continue
        begin, end = entry["data_offsets"]
        blobs.append(data[begin:end])
        old[name] = {**entry, "data_offsets": [offset, offset + end - begin]}
        offset += end - begin
    text = json.dumps(old, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    if len(text) % 64 == 56:  # 8 + len(text) would be on 64 bytes
        text += b" " * 8
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def test_a_file_in_the_layout_before_pages_still_restores(tmp_path):
    tree = {"step": np.int32(7), "w": np.arange(2048, dtype=np.float32), "b": np.ones(3)}
    path = save_checkpoint(tmp_path, tree, 1)
    _rewrite_in_the_old_layout(path)
    data_start, spans, _ = _sections(path)
    assert data_start % 64 != 0 and [n for *_, n in spans] == ["b", "step", "w"]
    assert_trees_equal(restore_checkpoint(tmp_path, tree), tree)
    assert_trees_equal(restore_checkpoint(path, None), tree)


def test_a_file_written_by_safetensors_itself_restores_into_a_target(tmp_path):
    arrays = {"a": np.arange(7, dtype=np.float32), "b": np.ones((3, 5), np.int8)}
    safetensors.numpy.save_file(arrays, os.fspath(tmp_path / "checkpoint_1.safetensors"))
    target = {name: np.zeros_like(value) for name, value in arrays.items()}
    assert_trees_equal(restore_checkpoint(tmp_path, target, host_window_bytes=8), arrays)


def test_the_largest_header_a_reader_accepts_is_written_and_one_byte_more_is_refused(tmp_path):
    # A 4-byte step first in tree order but last in the file: the offsets' digits differ
    # between the two orders, so a size check in the wrong order would disagree.
    def tree(note_length):
        return {"step": np.int32(1), "w": np.ones(1 << 18, np.float32), "z": "x" * note_length}

    def fits(note_length):
        description, tensors = _description.describe(tree(note_length))
        metadata = _format.base_metadata("1", description)
        try:
            _format.check_header_size(tensors, metadata)
        except ValueError:
            return False
        return True

    # The header grows by one byte per character of the note (no escaping): find where it
    # would need exactly MAX_HEADER_BYTES - 8 bytes unpadded (8 + that is on a page).
    path = save_checkpoint(tmp_path / "small", tree(0), 1)
    with open(path, "rb") as f:
        padded = int.from_bytes(f.read(8), "little")
        unpadded = len(f.read(padded).rstrip(b" "))
    largest = _format.MAX_HEADER_BYTES - 8 - unpadded
    assert fits(largest) and not fits(largest + 1)
    path = save_checkpoint(tmp_path / "largest", tree(largest), 1)
    with open(path, "rb") as f:
        assert int.from_bytes(f.read(8), "little") == _format.MAX_HEADER_BYTES - 8
    assert restore_checkpoint(path, None)["z"] == "x" * largest
    with pytest.raises(ValueError, match="save_checkpoint: the checkpoint header would be"):
        save_checkpoint(tmp_path / "over", tree(largest + 1), 1)
    assert not (tmp_path / "over").exists()  # refused before anything was written
