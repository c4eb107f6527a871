"""Saves and restores through the transfer pipeline: what an async save lets the caller do
right after it returns, and how much host memory a save or a restore holds.

Host memory is measured as the bytes the pipeline itself holds (`_window.held_bytes()`,
`peak_held_bytes()`): on a CPU backend process RSS also counts device memory, which is host
memory there, and the allocator's caches.
"""

import gc
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from eqx_train import checkpoints
from eqx_train.checkpoints.format import _format, _reader
from eqx_train.checkpoints.pipeline import _snapshot, _transfer, _window
from tests.support.helpers import assert_trees_equal, hold_the_writer

MiB = 1 << 20


def _device_state(leaves=16, leaf_mib: float = 1, seed=0):
    """Float32 leaves on the devices: most on one device, one sharded over all 8."""
    mesh = Mesh(np.array(jax.devices()), ("d",))
    n = int(leaf_mib * MiB) // 4
    state = {f"l{i:02d}": jnp.full(n, seed * 100 + i, jnp.float32) for i in range(leaves - 1)}
    state["sharded"] = jax.device_put(
        jnp.arange(n, dtype=jnp.float32) + seed, NamedSharding(mesh, P("d"))
    )
    return state


def _host_copy(state):
    return jax.tree.map(np.array, state)  # independent copies: the expected file contents


@pytest.fixture
def peak():
    """The pipeline's host bytes above what was held before the test: call it for the peak."""
    base = _window.held_bytes()
    _window.reset_peak()
    yield lambda: _window.peak_held_bytes() - base
    assert _window.held_bytes() == base  # everything let go


def _donating_step():
    return jax.jit(lambda s: jax.tree.map(lambda x: x * 0 - 7, s), donate_argnums=0)


# ------------------------------------------------------------------ donation after an async save


@pytest.mark.parametrize("snapshot", ["auto", "device", "host"])
def test_async_save_holds_the_state_of_the_call_when_the_next_step_donates_it(
    tmp_path, monkeypatch, snapshot
):
    state = _device_state(leaves=4)
    expected = _host_copy(state)
    go, writing = hold_the_writer(monkeypatch)
    manager = checkpoints.AsyncManager()
    checkpoints.save_checkpoint(tmp_path, state, 1, async_manager=manager, snapshot=snapshot)
    assert writing.wait(60)  # the background save is writing, and waits for us
    state = _donating_step()(state)
    jax.block_until_ready(state)
    go.set()
    manager.wait_previous_save()
    assert float(state["l00"][0]) == -7.0
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, None), expected)


def test_the_next_step_really_donates_the_buffers_the_save_was_given(tmp_path, monkeypatch):
    state = _device_state(leaves=2)
    go, writing = hold_the_writer(monkeypatch)
    manager = checkpoints.AsyncManager()
    checkpoints.save_checkpoint(tmp_path, state, 1, async_manager=manager, snapshot="device")
    assert writing.wait(60)
    _donating_step()(state)
    deleted = [leaf.is_deleted() for leaf in state.values()]
    go.set()
    manager.wait_previous_save()
    assert all(deleted)  # so the test above overwrote the very buffers being saved


def test_an_async_save_on_cpu_devices_lets_the_buffers_go_once_written(tmp_path, monkeypatch):
    state = _device_state(leaves=3)
    go, writing = hold_the_writer(monkeypatch)
    manager = checkpoints.AsyncManager()
    checkpoints.save_checkpoint(tmp_path, state, 1, async_manager=manager)  # "auto"
    assert writing.wait(60)
    _donating_step()(state)
    held_while_writing = not any(leaf.is_deleted() for leaf in state.values())
    go.set()
    manager.wait_previous_save()
    _donating_step()(state)
    assert held_while_writing and all(leaf.is_deleted() for leaf in state.values())


def test_checkpoint_manager_async_save_survives_donation(tmp_path, monkeypatch):
    state = _device_state(leaves=3)
    expected = _host_copy(state)
    go, writing = hold_the_writer(monkeypatch)
    with checkpoints.CheckpointManager(tmp_path, async_save=True) as manager:
        manager.save(1, state)
        assert writing.wait(60)
        state = _donating_step()(state)
        go.set()
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, None), expected)


def test_async_device_snapshot_frees_each_copy_once_it_is_written(tmp_path, monkeypatch):
    # Single-device leaves: a sharded one adds an array object per shard to the count.
    state = {f"l{i}": jnp.full(MiB // 4, i, jnp.float32) for i in range(4)}
    gc.collect()
    before = len(jax.live_arrays())
    live_while_writing = []
    real = _format.write_all

    def write_all(fd, data):
        live_while_writing.append(len(jax.live_arrays()))
        real(fd, data)

    monkeypatch.setattr(_format, "write_all", write_all)
    manager = checkpoints.AsyncManager()
    checkpoints.save_checkpoint(tmp_path, state, 1, async_manager=manager, snapshot="device")
    manager.wait_previous_save()
    # One call for the header, then one per 1 MiB leaf: the copies go as the leaves do.
    assert len(live_while_writing) == 5, live_while_writing
    assert live_while_writing[0] >= before + 4  # all four copies exist while writing begins
    assert live_while_writing[-1] <= before + 1, (before, live_while_writing)
    gc.collect()
    assert len(jax.live_arrays()) == before


@pytest.mark.parametrize("how", ["async", "object_store"])
def test_the_pinned_host_transfer_path_saves_bit_exactly_within_the_window(
    tmp_path, monkeypatch, peak, how
):
    # What an accelerator does (a CPU device is read in place): each leaf goes to pinned
    # host memory ahead of the writer, a sharded leaf counts twice (shards + assembled).
    monkeypatch.setattr(_transfer, "reads_in_place", lambda platform: False)
    pinned, real_put = [], jax.device_put

    def device_put(x, device=None, *args, **kwargs):
        if getattr(device, "memory_kind", None) == "pinned_host":
            pinned.append(x.shape)
        return real_put(x, device, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", device_put)
    state = _device_state(leaves=8)
    expected = _host_copy(state)
    directory = f"memory://{tmp_path.name}/pinned" if how == "object_store" else tmp_path
    manager = checkpoints.AsyncManager()
    checkpoints.save_checkpoint(
        directory, state, 1, async_manager=manager, snapshot="device", host_window_bytes=4 * MiB
    )
    state = _donating_step()(state)
    manager.wait_previous_save()
    assert 2 * MiB <= peak() <= 4 * MiB
    assert len(pinned) == (8 if how == "async" else 16)  # every leaf; twice for an upload
    assert_trees_equal(checkpoints.restore_checkpoint(directory, None), expected)


# ---------------------------------------------- what a snapshot holds, and until when


SNAPSHOTS = ["auto", "device", "host"]


@pytest.mark.parametrize("snapshot", SNAPSHOTS)
def test_a_leaf_that_appears_twice_is_saved_twice_by_an_async_save(tmp_path, snapshot):
    shared = jnp.arange(8.0) + 1
    state = {"params": shared, "ema_params": shared, "other": jnp.zeros(3)}
    expected = _host_copy(state)
    manager = checkpoints.AsyncManager()
    checkpoints.save_checkpoint(tmp_path, state, 1, async_manager=manager, snapshot=snapshot)
    manager.wait_previous_save()
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, None), expected)


@pytest.mark.parametrize("snapshot", SNAPSHOTS)
def test_an_upload_tried_again_rereads_the_snapshot(snapshot, monkeypatch):
    """A store that answers 501 to a conditional write: the upload is made again without
    the condition, and reads every leaf again (after the snapshot's first two passes)."""
    from eqx_train.checkpoints import _api
    from eqx_train.checkpoints.storage import _fsspec
    from tests.test_object_store_races import FakeS3

    fs = FakeS3()
    fs.refuse_conditions = True
    monkeypatch.setattr(
        _api._locations,
        "resolve",
        lambda path, options=None: (_fsspec.FsspecStorage("s3", fs), path),
    )
    state = _device_state(leaves=3, leaf_mib=1 / 8)
    expected = _host_copy(state)
    manager = checkpoints.AsyncManager()
    url = "s3://b/run"
    checkpoints.save_checkpoint(url, state, 1, async_manager=manager, snapshot=snapshot)
    manager.wait_previous_save()
    assert fs.opened_modes == ["xb", "wb"]  # tried again, without the condition
    assert_trees_equal(checkpoints.restore_checkpoint(url, None), expected)


@pytest.mark.parametrize("snapshot", SNAPSHOTS)
def test_a_failed_async_save_lets_go_of_its_snapshot(tmp_path, monkeypatch, snapshot):
    state = {f"l{i}": jnp.full(1000, i, jnp.float32) for i in range(4)}
    gc.collect()
    before = len(jax.live_arrays())
    pins = []
    real_pins = _transfer.Pins

    class Recorded(real_pins):
        def __init__(self, array):
            super().__init__(array)
            pins.append(self)

    monkeypatch.setattr(_transfer, "Pins", Recorded)

    def disk_full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_format, "write_all", disk_full)
    manager = checkpoints.AsyncManager()
    checkpoints.save_checkpoint(tmp_path, state, 1, async_manager=manager, snapshot=snapshot)
    with pytest.raises(OSError, match="No space left") as failure:
        manager.wait_previous_save()
    gc.collect()
    # The error (and its traceback) is still held here, as a user's handler would hold it.
    assert failure.value.__traceback__ is not None
    assert len(jax.live_arrays()) == before  # no device copy survives
    assert all(p.views is None for p in pins)  # no buffer stays pinned
    assert (snapshot == "auto") == bool(pins)
    monkeypatch.undo()
    checkpoints.save_checkpoint(tmp_path, state, 2, async_manager=manager, snapshot=snapshot)
    manager.wait_previous_save()
    assert checkpoints.available_steps(tmp_path) == [2]


# ------------------------------------------------------------------ device memory


def test_async_save_falls_back_to_a_host_snapshot_when_device_memory_is_short(
    tmp_path, monkeypatch
):
    # As on an accelerator: a CPU device's buffers are held in place, which needs no memory.
    monkeypatch.setattr(_transfer, "reads_in_place", lambda platform: False)
    monkeypatch.setattr(_snapshot, "free_device_bytes", lambda device: 1024)
    manager = checkpoints.AsyncManager()
    state = _device_state(leaves=2)
    expected = _host_copy(state)
    with pytest.warns(UserWarning, match="would not fit in device memory"):
        checkpoints.save_checkpoint(tmp_path, state, 1, async_manager=manager, keep=3)
    state = _donating_step()(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per manager
        checkpoints.save_checkpoint(tmp_path, state, 2, async_manager=manager, keep=3)
        checkpoints.save_checkpoint(
            tmp_path, state, 3, async_manager=manager, keep=3, snapshot="host"
        )  # chosen: silent
    manager.wait_previous_save()
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, None, step=1), expected)


def test_snapshot_and_window_options_are_refused_naming_the_value(tmp_path, without_type_checks):
    state = {"w": np.zeros(3)}
    with pytest.raises(ValueError, match=r"save_checkpoint: snapshot must be one of.*'pinned'"):
        checkpoints.save_checkpoint(tmp_path, state, 1, snapshot="pinned")  # pyright: ignore[reportArgumentType]  # a wrong value on purpose
    with pytest.raises(ValueError, match=r"save_checkpoint: host_window_bytes .* got 0"):
        checkpoints.save_checkpoint(tmp_path, state, 1, host_window_bytes=0)
    with pytest.raises(ValueError, match=r"CheckpointManager: snapshot must be one of"):
        checkpoints.CheckpointManager(tmp_path, snapshot="gpu")  # pyright: ignore[reportArgumentType]  # a wrong value on purpose
    with pytest.raises(ValueError, match=r"restore_checkpoint: host_window_bytes .* got -1"):
        checkpoints.restore_checkpoint(tmp_path, state, host_window_bytes=-1)
    assert not list(tmp_path.iterdir())  # nothing written


# ------------------------------------------------------------------ the bounded host window


@pytest.mark.parametrize("how", ["sync", "async", "shards", "object_store"])
def test_a_save_holds_at_most_its_host_window(tmp_path, peak, how):
    state = _device_state(leaves=16)
    expected = _host_copy(state)
    directory = f"memory://{tmp_path.name}/window" if how == "object_store" else tmp_path
    window = 4 * MiB
    if how == "async":
        manager = checkpoints.AsyncManager()
        checkpoints.save_checkpoint(
            directory, state, 1, async_manager=manager, host_window_bytes=window
        )
        manager.wait_previous_save()
    elif how == "shards":
        checkpoints.save_checkpoint_multiprocess(directory, state, 1, host_window_bytes=window)
    else:
        checkpoints.save_checkpoint(directory, state, 1, host_window_bytes=window)
    assert 2 * MiB <= peak() <= window  # several leaves in flight, never more than the window
    assert_trees_equal(checkpoints.restore_checkpoint(directory, None), expected)


def test_a_leaf_bigger_than_the_window_is_saved_alone(tmp_path, peak):
    state = {"big": jnp.arange(2 * MiB, dtype=jnp.float32), "small": jnp.ones(10)}
    checkpoints.save_checkpoint(tmp_path, state, 1, host_window_bytes=MiB)
    assert peak() == 8 * MiB
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, None), _host_copy(state))


def test_restore_onto_devices_holds_at_most_its_host_window(tmp_path, peak):
    saved = _device_state(leaves=16, seed=1)
    checkpoints.save_checkpoint(tmp_path, saved, 1)
    _window.reset_peak()
    target = _device_state(leaves=16, seed=2)
    restored = checkpoints.restore_checkpoint(tmp_path, target, host_window_bytes=4 * MiB)
    assert 2 * MiB <= peak() <= 4 * MiB
    assert_trees_equal(restored, _host_copy(saved))
    for name, leaf in restored.items():
        assert leaf.sharding == target[name].sharding, name  # the target's sharding, always


def test_a_restore_that_fails_midway_lets_go_of_its_window(tmp_path, peak, monkeypatch):
    checkpoints.save_checkpoint(tmp_path, _device_state(leaves=8), 1)
    reads = []
    real = _reader.FileReader.read_many

    def fail_third_group(self, names, **kw):
        reads.append(names)
        if len(reads) == 3:
            raise OSError("disk gone")
        return real(self, names, **kw)

    monkeypatch.setattr(_reader.FileReader, "read_many", fail_third_group)
    with pytest.raises(OSError, match="disk gone"):
        checkpoints.restore_checkpoint(tmp_path, _device_state(leaves=8), host_window_bytes=MiB)
    assert len(reads) == 3


def test_fifty_async_saves_hold_no_more_host_or_device_memory_than_one(tmp_path, peak):
    # Leaves of 1/8 MiB: what accumulates would show at any size; 50 saves of 8 MiB each
    # mostly measured the disk.
    window = MiB // 2
    manager = checkpoints.CheckpointManager(
        tmp_path, async_save=True, host_window_bytes=window, keep_latest=1
    )
    state = _device_state(leaves=8, leaf_mib=1 / 8)
    step = _donating_step()
    held, arrays, peaks = [], [], []
    # Other tests' garbage freed now, and what was alive before the loop set aside (frozen),
    # so that each collection inside it looks only at what the loop made: only what the
    # loop keeps alive counts, and a collection takes milliseconds rather than a second.
    gc.collect()
    gc.freeze()
    try:
        for i in range(50):
            manager.save(i, state)
            state = step(state)
            manager.wait()
            held.append(_window.held_bytes())
            gc.collect()
            arrays.append(len(jax.live_arrays()))
            peaks.append(peak())
    finally:
        gc.unfreeze()
    manager.close()
    assert len(set(held)) == 1 and len(set(arrays)) == 1, (held, arrays)  # nothing accumulates
    assert max(peaks) <= window
    assert_trees_equal(
        checkpoints.restore_checkpoint(tmp_path, None),
        jax.tree.map(lambda x: np.full_like(np.asarray(x), -7), state),
    )
