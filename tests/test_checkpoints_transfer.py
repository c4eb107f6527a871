"""Device snapshots and the bounded host window (`checkpoints/_transfer.py`).

The memory promises are checked on the bytes the pipeline itself holds
(`_window.held_bytes()` / `peak_held_bytes()`): on a CPU backend, process RSS also counts
device memory and the allocator's caches, which would blur them.
"""

import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from eqx_train.checkpoints._errors import calling
from eqx_train.checkpoints.format import _description
from eqx_train.checkpoints.pipeline import _snapshot, _transfer, _window
from eqx_train.checkpoints.pipeline._options import check_snapshot

MiB = 1 << 20


def _mesh():
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))


def _state():
    """Array leaves on one device, sharded over 8, replicated over 8; a key; host leaves."""
    mesh = _mesh()
    return {
        "one": jax.device_put(jnp.arange(12.0).reshape(3, 4), jax.devices()[3]),
        "sharded": jax.device_put(
            jnp.arange(64, dtype=jnp.int32).reshape(8, 8), NamedSharding(mesh, P("a", "b"))
        ),
        "replicated": jax.device_put(jnp.linspace(0, 1, 5), NamedSharding(mesh, P())),
        "key": jax.random.key(7),
        "numpy": np.arange(6, dtype=np.int16),
        "scalar": 3.5,
    }


def _tensors(tree):
    return _description.describe(tree)[1]


def _buffers(array):
    return {s.data.unsafe_buffer_pointer() for s in array.addressable_shards}


def _no_warning(message):
    raise AssertionError(f"unexpected warning: {message}")


def test_device_snapshot_copies_array_leaves_on_their_devices_with_their_shardings():
    tensors = _tensors(_state())
    copies = _snapshot.snapshot(tensors, "device", warn=_no_warning)
    for tensor, copy in zip(tensors, copies, strict=True):
        np.testing.assert_array_equal(copy.get(), np.asarray(tensor.get()))
        if isinstance(tensor.source, jax.Array):
            assert copy.owned and isinstance(copy.source, jax.Array)
            assert copy.source.sharding == tensor.source.sharding
            assert not _buffers(copy.source) & _buffers(tensor.source), tensor.name
        else:
            assert not copy.owned and copy.source is None


def test_device_snapshot_survives_donation_and_deletion_of_the_originals():
    state = {"w": jnp.arange(1000.0), "b": jnp.full((4, 4), 2, jnp.int32)}
    expected = {k: np.array(v) for k, v in state.items()}  # independent host copies
    copies = _snapshot.snapshot(_tensors(state), "device", warn=_no_warning)

    step = jax.jit(lambda s: jax.tree.map(lambda x: x * 3 + 1, s), donate_argnums=0)
    state = step(state)
    jax.block_until_ready(state)
    for copy in copies:
        np.testing.assert_array_equal(copy.get(), expected[copy.name])


def test_host_snapshot_copies_every_leaf_to_host_memory_now():
    state = {"w": jnp.arange(10.0), "n": np.zeros(3)}
    copies = _snapshot.snapshot(_tensors(state), "host", warn=_no_warning)
    state["n"][:] = 1.0
    state["w"].delete()
    assert [c.owned for c in copies] == [False, False]
    values = {c.name: c.get() for c in copies}
    np.testing.assert_array_equal(values["w"], np.arange(10.0))
    np.testing.assert_array_equal(values["n"], np.zeros(3))


def _as_on_an_accelerator(monkeypatch):
    """Devices whose memory is not host memory: `"auto"` then copies on the device (a CPU
    device's buffers are held in place instead, which needs no memory)."""
    monkeypatch.setattr(_transfer, "reads_in_place", lambda platform: False)


def test_auto_snapshot_on_a_cpu_device_holds_the_buffers_in_place(monkeypatch):
    monkeypatch.setattr(_snapshot, "free_device_bytes", lambda device: 0)  # no memory needed
    state = _state()
    tensors = _tensors(state)
    snaps = _snapshot.snapshot(tensors, "auto", warn=_no_warning)
    for tensor, snap in zip(tensors, snaps, strict=True):
        np.testing.assert_array_equal(snap.get(), np.asarray(tensor.get()))
        assert snap.source is None
    by_name = {t.name: t for t in snaps}
    # No copy: the value read is the caller's buffer itself.
    assert by_name["one"].get().ctypes.data == state["one"].unsafe_buffer_pointer()
    assert isinstance(by_name["sharded"].get, _transfer.Pins)


def test_pinned_buffers_survive_a_donating_step_and_are_let_go_once_released():
    state = {"w": jnp.arange(1000.0) + 1, "b": jnp.full((4, 4), 2, jnp.int32) + 0}
    expected = {k: np.array(v) for k, v in state.items()}
    snaps = _snapshot.snapshot(_tensors(state), "auto", warn=_no_warning)
    step = jax.jit(lambda s: jax.tree.map(lambda x: x * 3 + 1, s), donate_argnums=0)
    new = step(state)  # the runtime does not donate a buffer a view holds: it copies
    jax.block_until_ready(new)
    assert not any(leaf.is_deleted() for leaf in state.values())
    for snap in snaps:
        np.testing.assert_array_equal(snap.get(), expected[snap.name])
    np.testing.assert_array_equal(np.asarray(new["w"]), expected["w"] * 3 + 1)
    for snap in snaps:
        snap.get.release()  # pyright: ignore[reportFunctionMemberAccess]  # get carries it
    step(state)  # nothing holds the buffers now: really donated
    assert all(leaf.is_deleted() for leaf in state.values())


def test_auto_snapshot_falls_back_to_the_host_when_device_memory_is_short(monkeypatch):
    _as_on_an_accelerator(monkeypatch)
    monkeypatch.setattr(_snapshot, "free_device_bytes", lambda device: 1000)
    state = {"w": jnp.arange(1000.0)}  # 8000 bytes: more than 80% of 1000 free
    warn = _snapshot.WarnOnce()
    with pytest.warns(UserWarning, match=r"would not fit in device memory.*snapshot='host'"):
        copies = _snapshot.snapshot(_tensors(state), "auto", warn=warn)
    assert not copies[0].owned
    np.testing.assert_array_equal(copies[0].get(), np.arange(1000.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: the second fallback is silent
        again = _snapshot.snapshot(_tensors(state), "auto", warn=warn)
    assert not again[0].owned


def test_auto_snapshot_stays_on_the_device_when_it_fits(monkeypatch):
    _as_on_an_accelerator(monkeypatch)
    monkeypatch.setattr(_snapshot, "free_device_bytes", lambda device: 1 << 30)
    copies = _snapshot.snapshot(_tensors({"w": jnp.arange(1000.0)}), "auto", warn=_no_warning)
    assert copies[0].owned and isinstance(copies[0].source, jax.Array)


def test_device_snapshot_is_forced_even_when_memory_looks_short(monkeypatch):
    monkeypatch.setattr(_snapshot, "free_device_bytes", lambda device: 0)
    copies = _snapshot.snapshot(_tensors({"w": jnp.arange(1000.0)}), "device", warn=_no_warning)
    assert copies[0].owned


def test_device_memory_need_counts_each_devices_shard_and_every_replica():
    mesh = _mesh()
    sharded = jax.device_put(jnp.zeros((8, 8), jnp.float32), NamedSharding(mesh, P("a", "b")))
    replicated = jax.device_put(jnp.zeros(10, jnp.float32), NamedSharding(mesh, P()))
    need = _snapshot.device_bytes_needed([sharded, replicated])
    assert set(need) == set(jax.devices())
    assert all(n == 8 * 8 * 4 // 8 + 40 for n in need.values())


class _FakeDevice:
    platform = "gpu"

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_free_device_bytes_reads_the_backends_memory_statistics():
    stats = {"bytes_limit": 80 * MiB, "bytes_in_use": 30 * MiB}
    assert _snapshot.free_device_bytes(_FakeDevice(stats)) == 50 * MiB
    reservable = {**stats, "bytes_reservable_limit": 60 * MiB}
    assert _snapshot.free_device_bytes(_FakeDevice(reservable)) == 30 * MiB
    assert _snapshot.free_device_bytes(_FakeDevice(None)) is None
    assert _snapshot.free_device_bytes(_FakeDevice({})) is None
    free = _snapshot.free_device_bytes(jax.devices()[0])  # CPU: the host's available memory
    assert free is not None and free > 0


def test_snapshot_options_are_checked_with_the_offending_value():
    with calling("save"), pytest.raises(ValueError, match=r"save: snapshot must be one of .*'gpu'"):
        check_snapshot("gpu", 1)
    for bad in (0, -5, 1.5, True, "1"):
        with pytest.raises(ValueError, match="host_window_bytes must be a positive int"):
            check_snapshot("auto", bad)


# ------------------------------------------------------------------------ the host window


def _leaves(sizes_mib, device=True):
    tree = {
        f"l{i:02d}": jnp.full(int(s * MiB) // 4, i, jnp.float32)
        if device
        else np.full(int(s * MiB) // 4, i, np.float32)
        for i, s in enumerate(sizes_mib)
    }
    return _tensors(tree)


def _consume(tensors, limit):
    """Reads every leaf through the pipeline; returns the bytes held at each leaf and
    checks each value against an independent expectation."""
    held = []
    pipeline = _transfer.host_arrays(tensors, _window.HostWindow(limit))
    for i, (tensor, value) in enumerate(pipeline):
        assert tensor.name == f"l{i:02d}"
        assert value.shape == tensor.shape and np.all(value == i)
        held.append(_window.held_bytes())
    return held


@pytest.mark.parametrize("device", [True, False])
def test_the_pipeline_holds_at_most_the_window_and_reads_ahead_within_it(device):
    tensors = _leaves([1] * 16, device)
    start = _window.held_bytes()
    held = _consume(tensors, 4 * MiB)
    assert len(held) == len(tensors)
    assert max(held) - start == 4 * MiB  # four leaves at once: the window, not more
    assert _window.held_bytes() == start


def test_a_leaf_bigger_than_the_window_is_held_alone():
    tensors = _leaves([1, 6, 1, 1])
    start = _window.held_bytes()
    held = [h - start for h in _consume(tensors, 2 * MiB)]
    assert held[1] == 6 * MiB  # the big leaf, and nothing else with it
    assert max(held) == 6 * MiB and held[0] <= 2 * MiB and held[2] <= 2 * MiB


def test_the_pipeline_releases_what_it_holds_when_closed_early():
    tensors = _leaves([1] * 8)
    start = _window.held_bytes()
    pipeline = _transfer.host_arrays(tensors, _window.HostWindow(3 * MiB))
    next(pipeline)
    assert _window.held_bytes() - start == 3 * MiB
    pipeline.close()
    assert _window.held_bytes() == start


def test_the_final_pass_over_a_snapshot_frees_nothing_the_caller_owns():
    state = {"w": jnp.arange(100.0)}
    tensors = _tensors(state)
    copies = _snapshot.snapshot(tensors, "device", warn=_no_warning)
    for _ in _transfer.host_arrays(copies, _window.HostWindow(MiB)):
        pass
    assert not state["w"].is_deleted()
    np.testing.assert_array_equal(np.asarray(state["w"]), np.arange(100.0))


def test_a_leaf_that_changed_while_being_saved_is_refused_naming_it():
    tensors = _tensors({"w": np.zeros(4)})
    changed = [_description.Tensor("w", lambda: np.zeros(5), tensors[0].dtype, tensors[0].shape)]
    with pytest.raises(RuntimeError, match=r"leaf 'w' changed from float64\[4\] to float64\[5\]"):
        list(_transfer.host_arrays(changed, _window.HostWindow(MiB)))


def test_the_window_blocks_an_acquire_until_enough_is_released():
    window = _window.HostWindow(10)
    window.acquire(8)
    admitted = threading.Event()

    def second():
        window.acquire(5)
        admitted.set()

    thread = threading.Thread(target=second)
    thread.start()
    assert not admitted.wait(0.2)  # 8 + 5 > 10: it waits
    window.release(8)
    assert admitted.wait(10)
    thread.join()
    window.release(5)
    assert window.in_use == 0
