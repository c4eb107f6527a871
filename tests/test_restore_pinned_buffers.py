"""A restore onto an accelerator reads its tensors into one DMA-mapped host arena per client,
reused from restore to restore, and frees each block only once its tensor is on its
devices (`pipeline._pinned`).

CPUs have no DMA mapping, so here the arena is made for CPU devices on purpose (a recorded
fake `dma_map`): a CPU device adopts the host buffer it is placed from, which makes a block
reused too early show up as a wrong leaf, the very failure the arena must never cause on a
GPU (where it would be a leaf copied from bytes already overwritten).
"""

from __future__ import annotations

import _thread
import signal
import threading
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints import CheckpointFormatError
from eqx_train.checkpoints.format import _checksums
from eqx_train.checkpoints.format._arrays import buffer_for
from eqx_train.checkpoints.format._reader import FileReader
from eqx_train.checkpoints.pipeline import _pinned, _read, _restore, _transfer, _window
from eqx_train.checkpoints.storage._local_files import LocalSource
from tests.support.helpers import main_thread_is_in

# Every interrupt below is delivered as SIGINT, which must raise however the suite started.
pytestmark = pytest.mark.usefixtures("interruptible")

MIB = 2**20


def _arenas() -> list[_pinned.Arena]:
    return [a for _, a in _pinned._arenas.values() if a is not None]


def _state(leaves: int = 12) -> dict[str, Any]:
    """Leaves of 512 KiB with distinct values, and a few that are not plain arrays."""
    state: dict[str, Any] = {
        f"w{i:02d}": jnp.arange(i * 131072, (i + 1) * 131072, dtype=jnp.float32)
        for i in range(leaves)
    }
    state["bf16"] = jnp.linspace(-1, 1, 1000, dtype=jnp.bfloat16)
    state["complex"] = jnp.arange(6, dtype=jnp.complex64) * (1 + 2j)
    state["empty"] = jnp.zeros((0, 3))
    state["numpy"] = np.arange(5.0)
    state["key"] = jax.random.key(3)
    return state


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _assert_same(restored: Any, state: Any) -> None:
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(state), strict=True
    ):
        if _is_key(b):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)


def _zeros(state: Any) -> Any:
    return jax.tree.map(
        lambda x: (
            x
            if _is_key(x)
            else (np.zeros_like(x) if isinstance(x, np.ndarray) else jnp.zeros_like(x))
        ),
        state,
    )


def test_restores_read_into_one_arena_mapped_once_and_reused(tmp_path, arena, monkeypatch):
    state = _state()
    checkpoints.save_checkpoint(tmp_path, state, 0)
    handed: list[int] = []
    allocate = _pinned.Arena.allocate

    def counted(self, shape, dtype):
        block = allocate(self, shape, dtype)
        handed.append(0 if block is None else block.nbytes)
        return block

    monkeypatch.setattr(_pinned.Arena, "allocate", counted)
    for _ in range(3):
        # A window of 2 MiB: at most 4 leaves of 512 KiB in flight, the arena reused within
        # each restore as well as between them.
        restored = checkpoints.restore_checkpoint(
            tmp_path, _zeros(state), host_window_bytes=2 * MIB
        )
        _assert_same(restored, state)
    assert len(arena) == 1 and arena[0][1] == 4 * MIB  # mapped once, for the first restore
    assert sum(handed) >= 3 * 12 * 512 * 1024  # every float32 leaf, every time
    assert [a.in_use() for a in _arenas()] == [0]


@pytest.mark.parametrize("memory_kind", ["pinned_host", "unpinned_host"])
def test_a_target_in_host_memory_gets_buffers_of_its_own(tmp_path, arena, monkeypatch, memory_kind):
    """A leaf placed in host memory may keep the very buffer it is placed from: a block
    would then be reused under it."""
    state = {f"w{i}": jnp.full(131072, i, jnp.float32) for i in range(6)}
    checkpoints.save_checkpoint(tmp_path, state, 0)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=memory_kind)
    handed: list[Any] = []
    allocate = _pinned.Arena.allocate
    monkeypatch.setattr(
        _pinned.Arena, "allocate", lambda self, *a: handed.append(a) or allocate(self, *a)
    )
    for _ in range(2):
        target = {k: jax.device_put(jnp.zeros_like(v), sharding) for k, v in state.items()}
        restored = checkpoints.restore_checkpoint(tmp_path, target, host_window_bytes=2 * MIB)
        _assert_same(restored, state)
        assert {x.sharding.memory_kind for x in restored.values()} == {memory_kind}
    assert handed == []


def test_a_block_is_freed_only_after_its_tensor_is_on_its_devices(tmp_path, arena, monkeypatch):
    state = _state()
    checkpoints.save_checkpoint(tmp_path, state, 0)
    events: list[str] = []
    settle, free = _restore.settle_placed, _pinned.Arena.free
    monkeypatch.setattr(
        _restore, "settle_placed", lambda placed: (events.append("settle"), settle(placed))
    )
    monkeypatch.setattr(
        _pinned.Arena, "free", lambda self, a: (events.append("free"), free(self, a))
    )
    checkpoints.restore_checkpoint(tmp_path, _zeros(state), host_window_bytes=2 * MIB)
    assert "free" in events
    assert events[0] == "settle"
    for i, event in enumerate(events):
        if event == "free":
            assert "settle" in events[:i]


def test_a_block_reused_while_a_cpu_device_still_holds_it_is_caught(tmp_path, arena, monkeypatch):
    """The planted bug: without the copy a CPU device needs, a later tensor overwrites an
    earlier leaf through the block they shared. This is what the tests above would see."""
    state = _state()
    checkpoints.save_checkpoint(tmp_path, state, 0)
    monkeypatch.setattr(_read._PinnedBlocks, "unshared", lambda self, name, target, host: host)
    restored = checkpoints.restore_checkpoint(tmp_path, _zeros(state), host_window_bytes=2 * MIB)
    with pytest.raises(AssertionError):
        _assert_same(restored, state)


def test_a_corrupt_tensor_leaves_no_block_in_use(tmp_path, arena):
    state = _state()
    path = checkpoints.save_checkpoint(tmp_path, state, 0)
    with open(path, "r+b") as file:
        file.seek(-4096, 2)
        file.write(b"\xff" * 16)
    with pytest.raises(CheckpointFormatError, match="fails its checksum"):
        checkpoints.restore_checkpoint(tmp_path, _zeros(state), host_window_bytes=2 * MIB)
    assert [a.in_use() for a in _arenas()] == [0]


def test_onto_an_accelerator_each_group_is_checked_while_its_transfers_run(
    tmp_path, arena, monkeypatch
):
    # Read without checking, placed, then checked (parts at once on the shared readers),
    # all before the restore returns: a tensor as large as the window is not held back
    # from its device by its own checksum.
    events: list[tuple[str, Any]] = []
    read_many, verify_read = FileReader.read_many, FileReader.verify_read
    real_place = _restore.place

    def reading(self, names, *, verify=True, **kwargs):
        events.append(("read", (tuple(names), verify)))
        return read_many(self, names, verify=verify, **kwargs)

    def checking(self, arrays):
        events.append(("check", tuple(arrays)))
        return verify_read(self, arrays)

    def placing(kind, target, array):
        events.append(("place", None))
        return real_place(kind, target, array)

    monkeypatch.setattr(FileReader, "read_many", reading)
    monkeypatch.setattr(FileReader, "verify_read", checking)
    monkeypatch.setattr(_restore, "place", placing)
    state = _state()
    checkpoints.save_checkpoint(tmp_path, state, 0)
    _assert_same(checkpoints.restore_checkpoint(tmp_path, _zeros(state)), state)
    # (The Python scalars of modules are read apart, checked as they are read: none here.)
    reads = [value for kind, value in events if kind == "read" and value[0]]
    checked = [names for kind, names in events if kind == "check"]
    assert reads and not any(verify for _, verify in reads)
    assert sorted(n for group in checked for n in group) == sorted(n for g, _ in reads for n in g)
    # A group's check comes after its leaves' placements.
    assert events.index(("check", checked[0])) > events.index(("place", None))


@pytest.mark.parametrize("options", [{"verify": False}, {"threaded_reads": False}])
def test_unverified_or_unthreaded_restores_check_nothing_later(
    tmp_path, arena, monkeypatch, options
):
    monkeypatch.setattr(FileReader, "verify_read", lambda self, arrays: pytest.fail("checked"))
    state = _state()
    checkpoints.save_checkpoint(tmp_path, state, 0)
    _assert_same(checkpoints.restore_checkpoint(tmp_path, _zeros(state), **options), state)


def test_a_tensor_corrupt_in_one_part_fails_after_placement_naming_the_part(
    tmp_path, arena, monkeypatch
):
    monkeypatch.setattr(_checksums, "PART_BYTES", 64 * 1024)
    state = {"w": jnp.arange(MIB // 2, dtype=jnp.float32), "b": jnp.ones(3)}  # 32 parts
    path = checkpoints.save_checkpoint(tmp_path, state, 0)
    with FileReader(str(path)) as reader:
        start = reader.tensors["w"].start
    with open(path, "r+b") as file:
        file.seek(start + 5 * 64 * 1024 + 11)
        file.write(b"\x7f")
    with pytest.raises(CheckpointFormatError, match="tensor 'w' fails its checksum in its part 5 "):
        checkpoints.restore_checkpoint(tmp_path, _zeros(state))
    assert [a.in_use() for a in _arenas()] == [0]


def test_after_a_failed_check_each_block_is_freed_only_once_its_transfers_are_over(
    tmp_path, arena, monkeypatch
):
    # The leaves placed from a group that then fails its check are never settled by the
    # caller; their transfers may still read the blocks, which the next restore would
    # overwrite and `_pinned.release` unmap.
    events: list[tuple[str, Any]] = []
    ready, free = jax.block_until_ready, _pinned.Arena.free

    def waited(x):
        events.append(("ready", [id(a) for a in jax.tree.leaves(x)]))
        return ready(x)

    def freed(self, array):
        events.append(("free", None))
        return free(self, array)

    placed: list[int] = []
    real_place = _restore.place

    def placing(kind, target, array):
        leaf = real_place(kind, target, array)
        placed.append(id(leaf))
        return leaf

    monkeypatch.setattr(jax, "block_until_ready", waited)
    monkeypatch.setattr(_pinned.Arena, "free", freed)
    monkeypatch.setattr(_restore, "place", placing)
    # Placed from the block itself, as on an accelerator (a CPU device gets a copy).
    monkeypatch.setattr(_read, "reads_in_place", lambda platform: False)
    state = {"w": jnp.arange(MIB // 2, dtype=jnp.float32)}
    path = checkpoints.save_checkpoint(tmp_path, state, 0)
    with open(path, "r+b") as file:
        file.seek(-100, 2)
        file.write(b"\x01")
    with pytest.raises(CheckpointFormatError, match="tensor 'w' fails its checksum"):
        checkpoints.restore_checkpoint(tmp_path, _zeros(state))
    first_free = events.index(("free", None))
    waited_for = {i for kind, ids in events[:first_free] if kind == "ready" for i in ids}
    assert placed and set(placed) <= waited_for
    assert [a.in_use() for a in _arenas()] == [0]


def test_a_check_failing_after_a_failed_placement_is_the_error_raised():
    # Corrupt bytes can make a placement fail in its own way: the checksum says why.
    def place(name, array):
        raise RuntimeError("cannot place garbage")

    def check(arrays):
        raise CheckpointFormatError("tensor 'a' fails its checksum")

    reads = _transfer.windowed_reads(
        ["a"],
        lambda name: 8,
        lambda group: {name: np.zeros(2) for name in group},
        _window.HostWindow(64),
        settle=lambda group: None,
        place=place,
        check=check,
    )
    with pytest.raises(CheckpointFormatError, match="fails its checksum") as caught:
        list(reads)
    assert isinstance(caught.value.__context__, RuntimeError)


def test_an_interrupted_restore_leaves_no_block_in_use_and_restores_again(
    tmp_path, arena, monkeypatch
):
    state = _state()
    checkpoints.save_checkpoint(tmp_path, state, 0)
    monkeypatch.setattr(_transfer, "group_taken", lambda: _thread.interrupt_main())
    before = _window.held_bytes()
    with pytest.raises(KeyboardInterrupt):
        checkpoints.restore_checkpoint(tmp_path, _zeros(state), host_window_bytes=2 * MIB)
    assert [a.in_use() for a in _arenas()] == [0]
    assert _window.held_bytes() == before
    monkeypatch.setattr(_transfer, "group_taken", lambda: None)
    _assert_same(checkpoints.restore_checkpoint(tmp_path, _zeros(state)), state)


def test_a_second_interrupt_while_a_restore_stops_frees_no_block_a_reader_still_fills(
    tmp_path, arena, monkeypatch
):
    state = _state()
    checkpoints.save_checkpoint(tmp_path, state, 0)
    filling, release = [], threading.Event()
    read_into = LocalSource.read_into

    def slow_read(self, view, offset):  # a read that the disk holds up
        if not threading.current_thread().name.startswith("eqx_train-restore-read"):
            return read_into(self, view, offset)
        filling.append(offset)
        try:
            assert release.wait(30)
            return read_into(self, view, offset)
        finally:
            filling.remove(offset)

    def second_interrupt():
        deadline = time.monotonic() + 30
        while not main_thread_is_in("wait_through_interrupts") and time.monotonic() < deadline:
            time.sleep(0.001)  # until the restore waits for its readers
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)  # Ctrl-C again
        time.sleep(0.2)
        release.set()

    def group_taken():
        if not release.is_set() and not second.is_alive():
            second.start()
            _thread.interrupt_main()

    second = threading.Thread(target=second_interrupt, daemon=True)
    monkeypatch.setattr(LocalSource, "read_into", slow_read)
    monkeypatch.setattr(_transfer, "group_taken", group_taken)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.restore_checkpoint(tmp_path, _zeros(state), host_window_bytes=2 * MIB)
    second.join(30)
    # Raised only once no reader writes into a block: a block freed under a read would take
    # its bytes after the next restore had read and verified its own there.
    assert filling == []
    assert [a.in_use() for a in _arenas()] == [0]
    monkeypatch.setattr(_transfer, "group_taken", lambda: None)
    _assert_same(checkpoints.restore_checkpoint(tmp_path, _zeros(state)), state)


def test_restores_in_several_threads_share_the_arena(tmp_path, arena):
    states = [
        jax.tree.map(
            lambda x, i=i: x + i if isinstance(x, jax.Array) and x.dtype == jnp.float32 else x,
            _state(),
        )
        for i in range(3)
    ]
    for i, state in enumerate(states):
        checkpoints.save_checkpoint(tmp_path / str(i), state, 0)
    results: dict[int, Any] = {}

    def restore(i: int) -> None:
        results[i] = checkpoints.restore_checkpoint(
            tmp_path / str(i), _zeros(states[i]), host_window_bytes=2 * MIB
        )

    threads = [threading.Thread(target=restore, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for i, state in enumerate(states):
        _assert_same(results[i], state)
    assert len(arena) == 1 and [a.in_use() for a in _arenas()] == [0]


def test_equinox_modules_with_batch_norm_state_restore_through_the_arena(tmp_path, arena):
    model, bn_state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(64, "batch", mode="batch")
    mlp = eqx.nn.MLP(64, 64, 256, 2, key=jax.random.key(0))
    tree = (mlp, model, bn_state)
    checkpoints.save_checkpoint(tmp_path, tree, 0)
    target = jax.tree.map(lambda x: jnp.zeros_like(x) if eqx.is_array(x) else x, tree)
    restored = checkpoints.restore_checkpoint(tmp_path, target)
    assert eqx.tree_equal(restored, tree)


def test_a_runtime_without_dma_mapping_gets_no_arena_and_restores_as_before(tmp_path, monkeypatch):
    monkeypatch.setattr(_pinned, "eligible", lambda platform: True)
    monkeypatch.setattr(_pinned, "_arenas", {})
    # The real call: a CPU client answers UNIMPLEMENTED.
    state = _state()
    checkpoints.save_checkpoint(tmp_path, state, 0)
    _assert_same(checkpoints.restore_checkpoint(tmp_path, _zeros(state)), state)
    assert [a for _, a in _pinned._arenas.values()] == [None]  # refused once, remembered


def test_a_cpu_device_gets_no_arena():
    assert _pinned.arena_for(jax.devices("cpu")[0]) is None


def test_the_arena_hands_out_page_aligned_blocks_and_merges_freed_neighbours():
    arena = _pinned.Arena(16 * 4096, lambda a, n: None)
    a = arena.allocate((4096,), np.dtype(np.float32))  # 4 pages
    b = arena.allocate((100,), np.dtype(np.uint8))  # 1 page
    c = arena.allocate((3, 4096), np.dtype(np.uint8))  # 3 pages
    assert a is not None and b is not None and c is not None
    assert all(x.ctypes.data % 4096 == 0 for x in (a, b, c))
    assert arena.in_use() == 8 * 4096
    assert arena.allocate((9 * 4096,), np.dtype(np.uint8)) is None  # 8 pages left
    assert arena.allocate((0, 5), np.dtype(np.float32)) is None  # nothing to transfer
    arena.free(a)
    arena.free(b)  # merges with a's block: 5 pages free at the start
    d = arena.allocate((5 * 4096,), np.dtype(np.uint8))
    assert d is not None and d.ctypes.data == arena.address
    arena.free(c)
    arena.free(d)
    assert arena.in_use() == 0
    whole = arena.allocate((16 * 4096,), np.dtype(np.uint8))  # everything merged back
    assert whole is not None
    with pytest.raises(KeyError):
        arena.free(whole[4096:])  # not a block it handed out


def test_an_arena_released_while_unused_is_unmapped_and_made_again(monkeypatch):
    unmapped: list[int] = []

    class Client:
        def dma_map(self, address: int, nbytes: int) -> None:
            pass

        def dma_unmap(self, address: int) -> None:
            unmapped.append(address)

    class Device:
        platform = "gpu"
        client = Client()

    monkeypatch.setattr(_pinned, "_arenas", {})
    monkeypatch.setattr(_pinned, "ARENA_BYTES", 8192)
    first = _pinned.arena_for(Device())
    assert first is not None and _pinned.arena_for(Device()) is first
    block = first.allocate((10,), np.dtype(np.uint8))
    _pinned.release()
    assert unmapped == []  # a block is in use: kept
    assert block is not None
    first.free(block)
    _pinned.release()
    assert unmapped == [first.address]
    # A restore that got the arena before the release gets no block of unmapped memory.
    assert first.allocate((10,), np.dtype(np.uint8)) is None
    assert _pinned.arena_for(Device()) is not first


def test_a_buffer_offered_for_a_tensor_must_fit_it():
    wrong = np.zeros((3, 2), np.float32)
    with pytest.raises(ValueError, match="C-contiguous float32\\[2, 3\\]"):
        buffer_for("w", (2, 3), np.dtype(np.float32), lambda *_: wrong)
    with pytest.raises(ValueError, match="tensor 'w'"):
        buffer_for("w", (3, 2), np.dtype(np.float32), lambda *_: np.zeros((2, 3), np.float32).T)
    assert buffer_for("w", (3, 2), np.dtype(np.float32), lambda *_: None).shape == (3, 2)
