"""`progress=` on long transfers: a function `(done_bytes, total_bytes)` sees the bytes of
every tensor written or read, ending at done == total; `True` draws a tqdm bar on stderr;
a wrong value is refused at the call, naming it. Off by default."""

import sys
import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_train import _progress, checkpoints
from eqx_train.checkpoints import CheckpointManager, UnreadableCheckpointWarning
from eqx_train.interop import load_sharded, save_sharded
from tests.support.helpers import flip_last_byte

STATE = {
    "w": np.arange(1000, dtype=np.float32),  # 4000 bytes
    "b": np.ones((10, 10), np.float64),  # 800 bytes
    "model": eqx.nn.Linear(3, 2, key=jax.random.key(0)),  # 24 + 8 bytes, float32
}
BYTES = 4000 + 800 + 32


class Calls:
    """A progress function that records what it is told, and on which thread."""

    def __init__(self):
        self.seen: list[tuple[int, int]] = []
        self.threads: set[str] = set()

    def __call__(self, done: int, total: int) -> None:
        self.seen.append((done, total))
        self.threads.add(threading.current_thread().name)

    def check_whole(self, nbytes: int, *, calls: int = 3) -> None:
        assert self.seen, "never called"
        assert self.seen[-1] == (nbytes, nbytes)
        dones = [done for done, _ in self.seen]
        assert dones == sorted(dones), "done went backwards"
        assert all(done <= total for done, total in self.seen)
        assert len(self.seen) >= calls, self.seen  # reported as it went, not only at the end


def test_a_save_reports_every_tensor_byte_written(tmp_path):
    calls = Calls()
    checkpoints.save_checkpoint(tmp_path, STATE, 1, progress=calls)
    calls.check_whole(BYTES)


def test_a_restore_reports_every_tensor_byte_read_into_a_target_or_as_saved(tmp_path):
    checkpoints.save_checkpoint(tmp_path, STATE, 1)
    into_target = Calls()
    restored = checkpoints.restore_checkpoint(tmp_path, STATE, progress=into_target)
    into_target.check_whole(BYTES)
    assert eqx.tree_equal(restored, STATE)
    as_saved = Calls()
    checkpoints.restore_checkpoint(tmp_path, None, progress=as_saved)
    as_saved.check_whole(BYTES, calls=2)  # one group of reads: it is small


def test_a_restore_of_a_tree_as_saved_reports_as_groups_of_tensors_arrive(tmp_path, monkeypatch):
    from eqx_train.checkpoints.pipeline import _restore

    monkeypatch.setattr(_restore, "_REPORT_EVERY", 1000)
    checkpoints.save_checkpoint(tmp_path, STATE, 1)
    calls = Calls()
    checkpoints.restore_checkpoint(tmp_path, None, progress=calls)
    calls.check_whole(BYTES)
    # 0, then group by group: (b, the model's two) fit in 1000 bytes, w alone does not.
    assert [done for done, _ in calls.seen] == [0, 832, BYTES]


def test_an_async_save_reports_from_the_thread_that_writes(tmp_path):
    calls = Calls()
    manager = checkpoints.AsyncManager()
    checkpoints.save_checkpoint(tmp_path, STATE, 1, async_manager=manager, progress=calls)
    manager.wait_previous_save()
    calls.check_whole(BYTES)
    assert threading.current_thread().name not in calls.threads


def test_a_sharded_restore_counts_the_blocks_this_process_reads(tmp_path):
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    n = 8 * len(jax.devices())
    state = {"x": jax.device_put(jnp.arange(n, dtype=jnp.float32), sharded)}
    calls = Calls()
    checkpoints.save_checkpoint_multiprocess(tmp_path, state, 1, progress=calls)
    calls.check_whole(4 * n)
    read = Calls()
    restored = checkpoints.restore_checkpoint(tmp_path, state, progress=read)
    read.check_whole(4 * n)
    assert restored["x"].sharding == sharded
    np.testing.assert_array_equal(restored["x"], state["x"])


def test_a_manager_reports_its_saves_and_one_restore_across_a_fallback(tmp_path):
    manager = CheckpointManager(tmp_path, keep_latest=3, handle_sigterm=False)
    saves = Calls()
    for step in (1, 2):
        manager.save(step, STATE, progress=saves)
    manager.close()
    assert saves.seen.count((BYTES, BYTES)) == 2  # one report per save, each whole
    flip_last_byte(tmp_path / "checkpoint_2.safetensors")
    manager = CheckpointManager(tmp_path, keep_latest=3, handle_sigterm=False)
    calls = Calls()
    with pytest.warns(UnreadableCheckpointWarning):
        manager.restore(STATE, progress=calls)
    manager.close()
    # One report: the corrupt checkpoint's reads, then the fallback's, in one total.
    done, total = calls.seen[-1]
    assert total > BYTES and done <= total
    assert [t for _, t in calls.seen] == sorted(t for _, t in calls.seen)


def test_load_sharded_reports_its_reads(tmp_path):
    save_sharded(tmp_path, STATE, max_shard_size=2000)
    calls = Calls()
    load_sharded(tmp_path, STATE, progress=calls)
    calls.check_whole(BYTES)


def test_progress_true_draws_a_tqdm_bar_on_stderr(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tqdm")
    monkeypatch.setattr(_progress, "BAR_DELAY_S", 0.0)  # drawn at once, not after a second
    checkpoints.save_checkpoint(tmp_path, STATE, 1, progress=True)
    checkpoints.restore_checkpoint(tmp_path, STATE, progress=True)
    out, err = capsys.readouterr()
    assert out == ""
    assert "save" in err and "restore" in err and "B/s" in err, err


def test_a_short_transfer_draws_no_bar(tmp_path, capsys):
    pytest.importorskip("tqdm")
    checkpoints.save_checkpoint(tmp_path, STATE, 1, progress=True)
    checkpoints.restore_checkpoint(tmp_path, STATE, progress=True)
    assert capsys.readouterr().err == ""


def test_a_wrong_progress_value_is_refused_naming_the_call(tmp_path):
    # (The suite's run-time type checker refuses it first, by the annotation; without one,
    # the call's own check does, naming it.)
    with pytest.raises(TypeError, match="progress"):
        checkpoints.save_checkpoint(tmp_path, STATE, 1, progress="yes")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TypeError, match="progress"):
        checkpoints.restore_checkpoint(tmp_path, STATE, progress=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^restore_checkpoint: progress must be .* got 3\.$"):
        _progress.check_progress(3, "restore_checkpoint")


def test_progress_true_without_tqdm_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    with pytest.raises(ImportError, match="restore_checkpoint: progress=True .* pip install tqdm"):
        checkpoints.restore_checkpoint(tmp_path, STATE, progress=True)


def test_without_progress_no_report_is_opened(tmp_path, monkeypatch):
    """Off by default: nothing is reported, and the counters cost one lookup."""
    opened = []
    real = _progress._Report.__init__

    def spy(self, sink):
        opened.append(sink)
        real(self, sink)

    monkeypatch.setattr(_progress._Report, "__init__", spy)
    checkpoints.save_checkpoint(tmp_path, STATE, 1)
    checkpoints.restore_checkpoint(tmp_path, STATE)
    assert opened == []
    checkpoints.restore_checkpoint(tmp_path, STATE, progress=lambda done, total: None)
    assert len(opened) == 1
