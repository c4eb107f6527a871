"""The save and restore pipelines' stages: a slow disk does not slow the hashing and a slow
hash does not slow the disk; back-to-back async saves queue a second snapshot (at most two);
a device snapshot without room says so in our words; large tensors start on a page of the
file; a restore places leaves from several threads at once and synchronises with the
devices once per window group, not once per leaf.
"""

import os
import threading
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy

from eqx_train import TrainState, checkpoints
from eqx_train.checkpoints.format import _format, _reader
from eqx_train.checkpoints.pipeline import _restore, _snapshot, _transfer, _window
from tests.support.helpers import assert_trees_equal, hold_the_writer

LEAF = 256 << 10  # bytes of each leaf below


def _state(version=1, leaves=4):
    return {f"l{i}": jnp.full(LEAF // 4, version * 10 + i, jnp.float32) for i in range(leaves)}


# ------------------------------------------------------------------ the stages of a save


def test_a_slow_disk_does_not_hold_up_the_hashing(tmp_path, monkeypatch):
    hashed, saw = threading.Event(), []
    real_checksum, real_write = _format.tensor_checksum, _format.write_all

    def checksum(tensor, view):
        digest = real_checksum(tensor, view)
        hashed.set()
        return digest

    def write_all(fd, data):
        if len(data) == LEAF or data.nbytes == LEAF:  # the leaf's bytes, not the header
            saw.append(hashed.wait(30))  # the disk is stuck until the leaf is hashed
        real_write(fd, data)

    monkeypatch.setattr(_format, "tensor_checksum", checksum)
    monkeypatch.setattr(_format, "write_all", write_all)
    state = _state(leaves=1)
    checkpoints.save_checkpoint(tmp_path, state, 1)
    assert saw == [True]  # hashed while its write was still waiting
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, state), state)


def test_a_slow_hash_does_not_hold_up_the_disk(tmp_path, monkeypatch):
    written, saw, total = threading.Event(), [], [0]
    real_checksum, real_write = _format.tensor_checksum, _format.write_all

    def checksum(tensor, view):
        saw.append(written.wait(30))  # the hash is stuck until the leaf is on disk
        return real_checksum(tensor, view)

    def write_all(fd, data):
        real_write(fd, data)
        total[0] += len(data)
        if total[0] >= LEAF:  # the header and then the whole leaf
            written.set()

    monkeypatch.setattr(_format, "tensor_checksum", checksum)
    monkeypatch.setattr(_format, "write_all", write_all)
    state = _state(leaves=1)
    checkpoints.save_checkpoint(tmp_path, state, 1)
    assert saw == [True]  # written while its hash was still waiting
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, state), state)


def test_the_disk_is_asked_to_start_on_each_block_as_soon_as_it_is_written(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(_format, "_WRITE_BLOCK", LEAF // 2)
    monkeypatch.setattr(
        _format, "start_writeback", lambda fd, offset, n: started.append((offset, n))
    )
    state = _state(leaves=2)
    path = checkpoints.save_checkpoint(tmp_path, state, 1)
    header = os.path.getsize(path) - 2 * LEAF
    # Every data block, in order, right after its write: the final fsync waits for the tail.
    assert started == [(header + k * LEAF // 2, LEAF // 2) for k in range(4)]
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, state), state)


def test_the_stage_timings_name_every_stage_of_a_save_and_a_restore(tmp_path):
    state = _state()
    with _window.stage_times() as saving:
        checkpoints.save_checkpoint(tmp_path, state, 1)
    with _window.stage_times() as restoring:
        checkpoints.restore_checkpoint(tmp_path, state)
    assert {"transfer", "hash", "write", "fsync"} <= set(saving)
    assert {"read", "verify", "place"} <= set(restoring)
    assert all(seconds >= 0 for seconds in [*saving.values(), *restoring.values()])


def test_a_restore_waits_for_its_devices_once_per_window_group(tmp_path, monkeypatch):
    state = _state(leaves=8)
    checkpoints.save_checkpoint(tmp_path, state, 1)
    settled = []
    real = _restore.settle_placed
    monkeypatch.setattr(
        _restore, "settle_placed", lambda placed: (settled.append(len(placed)), real(placed))
    )
    restored = checkpoints.restore_checkpoint(tmp_path, state, host_window_bytes=8 * LEAF)
    assert settled == [2, 2, 2, 2]  # groups of a quarter of the window, each waited for once
    assert_trees_equal(restored, state)


def test_a_restore_places_several_groups_at_once_off_the_callers_thread(tmp_path, monkeypatch):
    # Copying from pageable host memory to an accelerator is a memcpy on the calling thread:
    # placed one leaf at a time by the caller, it would be the restore's slowest stage.
    state = _state(leaves=8)
    checkpoints.save_checkpoint(tmp_path, state, 1)
    both_placing = threading.Barrier(2, timeout=30)
    threads, real = [], _restore.place

    def place(kind, target, array):
        threads.append(threading.current_thread())
        if len(threads) <= 2:
            both_placing.wait()  # broken (an error) unless two leaves are placed at once
        return real(kind, target, array)

    monkeypatch.setattr(_restore, "place", place)
    _window.reset_peak()
    restored = checkpoints.restore_checkpoint(tmp_path, state, host_window_bytes=8 * LEAF)
    assert_trees_equal(restored, state)
    assert len(threads) == 8 and threading.main_thread() not in threads
    assert _window.peak_held_bytes() <= 8 * LEAF  # the window still bounds the host bytes


def test_a_leaf_that_cannot_be_placed_is_named_with_the_others_in_one_error(tmp_path, monkeypatch):
    saved = _state(leaves=8)
    checkpoints.save_checkpoint(tmp_path, saved, 1)
    # Every leaf matches by shape and dtype; two of them cannot be placed as the target says.
    target: dict[str, Any] = dict(saved)
    for name in ("l2", "l5"):
        target[name] = np.zeros(LEAF // 4, np.float32)
    real = _restore.place

    def place(kind, target_leaf, array):
        if isinstance(target_leaf, np.ndarray):
            raise ValueError("this target cannot hold it")
        return real(kind, target_leaf, array)

    monkeypatch.setattr(_restore, "place", place)
    before = _window.held_bytes()
    with pytest.raises(ValueError, match=r"(?s)'l2'.*this target cannot hold it.*'l5'"):
        checkpoints.restore_checkpoint(tmp_path, target, host_window_bytes=4 * LEAF)
    assert _window.held_bytes() == before  # every byte of the window let go


# ------------------------------------------------------------------ the file's layout


def test_large_tensors_start_on_a_page_even_after_a_four_byte_step(tmp_path):
    # A TrainState's 4-byte step comes first in tree order and Adam's 4-byte count in the
    # middle: laid out in tree order, every tensor after them would start off a page and
    # copy ~20% slower between the page cache and the host buffers.
    model = eqx.nn.MLP(64, 10, 512, 2, key=jax.random.key(0))
    state = TrainState.create(model=model, tx=optax.adam(1e-3))
    path = checkpoints.save_checkpoint(tmp_path, state, 1)
    with _reader.FileReader(path) as reader:
        infos = list(reader.tensors.values())
    paged = [info.name for info in infos if info.nbytes % 4096 == 0]
    assert len(paged) == 9  # three weights, and Adam's two moments of each
    assert all(i.start % 4096 == 0 for i in infos if i.name in paged)
    assert all(i.start % 64 == 0 for i in infos if i.nbytes % 64 == 0)
    # The header still lists the tensors in tree order (what `inspect` shows); only their
    # bytes moved.
    assert [i.name for i in infos][:3] == ["step", "model.layers.0.weight", "model.layers.0.bias"]
    step = next(i for i in infos if i.name == "step")
    assert step.start > max(i.start for i in infos if i.name in paged)
    # Still a plain safetensors file, and the same state.
    assert set(safetensors.numpy.load_file(path)) == {i.name for i in infos}
    assert eqx.tree_equal(checkpoints.restore_checkpoint(tmp_path, state), state)


def test_a_small_file_starts_its_data_on_64_bytes_without_a_page_of_padding(tmp_path):
    path = checkpoints.save_checkpoint(tmp_path, {"step": jnp.int32(3), "w": jnp.ones(5)}, 1)
    with open(path, "rb") as f:
        data_start = 8 + int.from_bytes(f.read(8), "little")
    assert data_start % 64 == 0 and os.path.getsize(path) - data_start == 4 + 20
    assert data_start < 4096


# ------------------------------------------------------------------ back-to-back async saves


def _in_a_thread(call):
    """Runs `call` in a thread; the returned event is set once it has returned."""
    returned = threading.Event()
    errors = []

    def run():
        try:
            call()
        except BaseException as error:  # reported by the test
            errors.append(error)
        returned.set()

    threading.Thread(target=run, daemon=True).start()
    return returned, errors


@pytest.mark.parametrize("snapshot", ["auto", "device", "host"])
def test_a_save_asked_for_while_one_is_written_is_queued_without_waiting(
    tmp_path, monkeypatch, snapshot
):
    go, writing = hold_the_writer(monkeypatch)
    manager = checkpoints.AsyncManager()
    states = {step: _state(step) for step in (1, 2, 3)}
    checkpoints.save_checkpoint(
        tmp_path, states[1], 1, async_manager=manager, keep=3, snapshot=snapshot
    )
    assert writing.wait(30)
    # The first is still being written (its writer is held): the second returns anyway.
    checkpoints.save_checkpoint(
        tmp_path, states[2], 2, async_manager=manager, keep=3, snapshot=snapshot
    )
    assert manager.in_flight() == 2
    # A third would make three snapshots: it waits until the first is written.
    third, errors = _in_a_thread(
        lambda: checkpoints.save_checkpoint(
            tmp_path, states[3], 3, async_manager=manager, keep=3, snapshot=snapshot
        )
    )
    assert not third.wait(0.5)
    assert manager.in_flight() == 2
    go.set()
    assert third.wait(60) and not errors
    manager.wait_previous_save()  # waits for every queued save
    assert manager.in_flight() == 0
    assert checkpoints.available_steps(tmp_path) == [1, 2, 3]
    for step, state in states.items():
        assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, state, step=step), state)


def test_a_second_snapshot_without_room_waits_for_the_first_save(tmp_path, monkeypatch):
    go, writing = hold_the_writer(monkeypatch)
    monkeypatch.setattr(_snapshot, "free_device_bytes", lambda device: LEAF)  # room for none
    manager = checkpoints.AsyncManager()
    checkpoints.save_checkpoint(
        tmp_path, _state(1), 1, async_manager=manager, snapshot="device", keep=2
    )
    assert writing.wait(30)
    second, errors = _in_a_thread(
        lambda: checkpoints.save_checkpoint(
            tmp_path, _state(2), 2, async_manager=manager, snapshot="device", keep=2
        )
    )
    assert not second.wait(0.5)  # blocked, as a save was before queues existed
    go.set()
    assert second.wait(60) and not errors
    manager.wait_previous_save()
    assert checkpoints.available_steps(tmp_path) == [1, 2]


def test_a_queued_save_of_a_step_that_is_not_newer_is_refused_after_the_first(
    tmp_path, monkeypatch
):
    go, writing = hold_the_writer(monkeypatch)
    manager = checkpoints.AsyncManager()
    checkpoints.save_checkpoint(tmp_path, _state(1), 5, async_manager=manager)
    assert writing.wait(30)
    again, errors = _in_a_thread(
        lambda: checkpoints.save_checkpoint(tmp_path, _state(2), 5, async_manager=manager)
    )
    assert not again.wait(0.5)  # it waits for the save of step 5 ...
    go.set()
    assert again.wait(60)
    assert len(errors) == 1 and "step 5" in str(errors[0])  # ... and is refused, as before
    manager.wait_previous_save()
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, _state(1)), _state(1))


# ------------------------------------------------------------------ a device snapshot without room


def test_a_device_snapshot_without_room_says_how_much_and_saves_nothing(tmp_path, monkeypatch):
    def out_of_memory(arrays):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1048576 bytes. "
            "jit__copy_arrays"
        )

    monkeypatch.setattr(_snapshot, "_device_copy", out_of_memory)
    monkeypatch.setattr(_snapshot, "free_device_bytes", lambda device: 3 << 20)
    manager = checkpoints.AsyncManager()
    state = {"w": jnp.zeros((4 << 20) // 4, jnp.float32), "b": np.ones(3, np.float32)}
    with pytest.raises(MemoryError) as failure:
        checkpoints.save_checkpoint(tmp_path, state, 1, async_manager=manager, snapshot="device")
    message = str(failure.value)
    assert "needs 4 MiB" in message and "3 MiB are free" in message
    assert "snapshot='host'" in message and "nothing was saved" in message
    manager.wait_previous_save()
    assert manager.in_flight() == 0
    assert checkpoints.available_steps(tmp_path) == []
    assert list(tmp_path.iterdir()) == []  # not even a temporary file


class _CopyThatFailsWhenItRuns:
    """A dispatched device copy whose run finds no room: the runtime reports it only when
    the copy is waited for (as XLA does for `jit__copy_arrays` on a full GPU)."""

    def __init__(self, like, deleted):
        self.sharding, self._deleted = like.sharding, deleted

    def block_until_ready(self):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4194304 bytes. "
            "[executable_name='jit__copy_arrays']"
        )

    def delete(self):
        self._deleted.append(self)


def _copies_that_fail_when_they_run(monkeypatch):
    """Makes every device copy one that is dispatched without error and fails when it runs;
    returns (the copies dispatched, the copies deleted)."""
    dispatched, deleted = [], []

    def copy_dispatched_without_error(arrays):
        dispatched.extend(_CopyThatFailsWhenItRuns(a, deleted) for a in arrays)
        return list(dispatched)

    monkeypatch.setattr(_snapshot, "_copy_jit", copy_dispatched_without_error)
    return dispatched, deleted


def test_a_device_snapshot_whose_copy_fails_when_it_runs_raises_memory_error_at_the_call(
    tmp_path,
    monkeypatch,
    without_type_checks,  # the failing copies below are not jax.Arrays
):
    dispatched, deleted = _copies_that_fail_when_they_run(monkeypatch)
    monkeypatch.setattr(_snapshot, "free_device_bytes", lambda device: 3 << 20)
    manager = checkpoints.AsyncManager()
    state = {"w": jnp.arange((4 << 20) // 4, dtype=jnp.float32), "b": np.ones(3, np.float32)}
    with pytest.raises(MemoryError) as failure:
        checkpoints.save_checkpoint(tmp_path, state, 1, async_manager=manager, snapshot="device")
    assert dispatched, "the copy was dispatched: it failed when it ran, not before"
    message = str(failure.value)
    assert "needs 4 MiB" in message and "3 MiB are free" in message
    assert "nothing was saved" in message
    assert deleted == dispatched  # the failed copies are let go at once
    manager.wait_previous_save()  # nothing left to report later
    assert manager.in_flight() == 0
    assert list(tmp_path.iterdir()) == []
    expected = np.arange((4 << 20) // 4, dtype=np.float32)
    assert np.array_equal(np.asarray(state["w"]), expected)  # the state stays usable


def test_an_auto_snapshot_whose_copy_fails_when_it_runs_is_taken_on_the_host(
    tmp_path,
    monkeypatch,
    without_type_checks,  # the failing copies below are not jax.Arrays
):
    # The estimate says the copy fits (plenty free), the copy finds no room when it runs:
    # "auto" chose the device, so it may choose the host instead, with a warning.
    dispatched, deleted = _copies_that_fail_when_they_run(monkeypatch)
    monkeypatch.setattr(_transfer, "reads_in_place", lambda platform: False)  # as on a GPU
    monkeypatch.setattr(_snapshot, "free_device_bytes", lambda device: 1 << 40)
    manager = checkpoints.AsyncManager()
    state = {"w": jnp.arange(1024, dtype=jnp.float32), "b": np.ones(3, np.float32)}
    with pytest.warns(UserWarning, match="found no room in device memory when it ran"):
        checkpoints.save_checkpoint(tmp_path, state, 1, async_manager=manager, snapshot="auto")
    assert dispatched and deleted == dispatched  # tried on the device, its copies let go
    manager.wait_previous_save()
    restored = checkpoints.restore_checkpoint(tmp_path, None)
    assert np.array_equal(restored["w"], np.arange(1024, dtype=np.float32))
    assert np.array_equal(restored["b"], np.ones(3, np.float32))
