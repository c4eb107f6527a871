"""CheckpointManager: retention union, metrics/metadata in the file, re-runs, async errors."""

import concurrent.futures
import json
import os
import textwrap
import threading

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from safetensors import safe_open

from eqx_train import EarlyStopping, TrainState, checkpoints
from eqx_train.checkpoints import CheckpointManager
from eqx_train.checkpoints.manager import _retention
from tests.support.helpers import flip_last_byte, latest_path, run_then_sigkill


def _state(value):
    return {"w": np.full(4, value, np.float32)}


# ---------------------------------------------------------------- options


def test_save_rejects_non_finite_step(tmp_path):
    with pytest.raises(ValueError, match="step must be finite"):
        CheckpointManager(tmp_path).save(float("nan"), _state(0))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep_best": 2}, "keep_best=2 needs best_metric"),
        ({"keep_latest": 0}, "keep_latest must be an int >= 1"),
        ({"keep_best": -1, "best_metric": "loss"}, "keep_best must be an int >= 0"),
        ({"keep_every_n_steps": 0}, "keep_every_n_steps must be a positive number"),
        ({"prefix": ""}, "prefix must be a non-empty"),
    ],
)
def test_options_are_validated_eagerly(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        CheckpointManager(tmp_path, **kwargs)


def test_unknown_mode_is_refused_naming_it(tmp_path, without_type_checks):
    with pytest.raises(ValueError, match="mode must be 'min' or 'max', got 'lowest'"):
        CheckpointManager(tmp_path, mode="lowest")  # pyright: ignore[reportArgumentType]  # a wrong value on purpose


# ---------------------------------------------------------------- retention


def test_keeps_latest_and_best_by_metric(tmp_path):
    manager = CheckpointManager(tmp_path, keep_latest=2, keep_best=1, best_metric="loss")
    losses = {1: 0.9, 2: 0.2, 3: 0.5, 4: 0.7, 5: 0.6}
    for step, loss in losses.items():
        manager.save(step, _state(step), metrics={"loss": loss})
    assert manager.all_steps() == [2, 4, 5]
    assert manager.best_step() == 2
    assert manager.latest_step() == 5


def test_best_never_evicts_the_newest(tmp_path):
    manager = CheckpointManager(tmp_path, keep_latest=1, keep_best=2, best_metric="acc", mode="max")
    for step, acc in enumerate([0.9, 0.95, 0.1, 0.2, 0.3]):
        manager.save(step, _state(step), metrics={"acc": acc})
    assert manager.all_steps() == [0, 1, 4]


def test_nan_or_missing_metric_never_counts_as_best(tmp_path):
    manager = CheckpointManager(tmp_path, keep_latest=1, keep_best=1, best_metric="loss")
    manager.save(1, _state(1), metrics={"loss": 0.5})
    manager.save(2, _state(2), metrics={"loss": float("nan")})
    manager.save(3, _state(3), metrics={"other": 0.0})
    manager.save(4, _state(4))
    assert manager.best_step() == 1
    assert manager.all_steps() == [1, 4]  # 1 is best; 2 (NaN) and 3 (missing) never count


def test_keep_every_n_steps_joins_the_union(tmp_path):
    manager = CheckpointManager(tmp_path, keep_latest=1, keep_every_n_steps=3)
    for step in range(1, 9):
        manager.save(step, _state(step))
    assert manager.all_steps() == [1, 4, 7, 8]


def test_restore_best_returns_state_saved_with_best_metric(tmp_path):
    manager = CheckpointManager(tmp_path, keep_latest=1, keep_best=1, best_metric="loss")
    for step, loss in enumerate([0.5, 0.1, 0.3]):
        manager.save(step, _state(step), metrics={"loss": loss})
    np.testing.assert_array_equal(manager.restore(_state(0), step="best")["w"], np.full(4, 1.0))
    np.testing.assert_array_equal(manager.restore(_state(0))["w"], np.full(4, 2.0))


def test_restore_best_without_usable_metric_says_so(tmp_path):
    manager = CheckpointManager(tmp_path, best_metric="loss")
    manager.save(1, _state(1))
    with pytest.raises(ValueError, match="usable 'loss' metric"):
        manager.restore(_state(0), step="best")


# ---------------------------------------------------------------- metrics and metadata


def test_metrics_and_metadata_live_in_the_checkpoint_file(tmp_path):
    manager = CheckpointManager(tmp_path)
    meta = {"lr": 1e-3, "model": {"width": 64}, "git": "abc123"}
    path = manager.save(7, _state(7), metrics={"loss": 0.25}, metadata=meta)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_7.safetensors"]
    with safe_open(path, "np") as f:
        stored = f.metadata()
    assert json.loads(stored["eqx_train.metrics"]) == {"loss": 0.25}
    assert json.loads(stored["eqx_train.user_metadata"]) == meta
    assert manager.metrics(7) == {"loss": 0.25}
    assert manager.metadata(7) == meta


def test_reading_metrics_reads_no_tensor_data(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"big": np.zeros((512, 1024), np.float32)}, metrics={"loss": 1.0})

    with open(latest_path(tmp_path), "rb") as f:
        header_end = 8 + int.from_bytes(f.read(8), "little")
    real_preadv = os.preadv

    def header_reads_only(fd, buffers, offset):
        if offset + sum(len(b) for b in buffers) > header_end:
            raise AssertionError("tensor data was read")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", header_reads_only)
    assert manager.metrics(1) == {"loss": 1.0}
    assert manager.metadata(1) is None
    assert manager.all_steps() == [1]


def test_bad_metric_and_metadata_are_rejected(tmp_path, without_type_checks):
    manager = CheckpointManager(tmp_path)
    with pytest.raises(TypeError, match="metric 'loss' must be a number"):
        manager.save(1, _state(1), metrics={"loss": "low"})  # pyright: ignore[reportArgumentType]  # a wrong value on purpose
    with pytest.raises(TypeError, match="JSON-serialisable"):
        manager.save(1, _state(1), metadata={"fn": print})
    assert manager.all_steps() == []


# ---------------------------------------------------------------- re-runs


def test_new_manager_picks_up_existing_checkpoints_and_metrics(tmp_path):
    first = CheckpointManager(tmp_path, keep_latest=2, keep_best=1, best_metric="loss")
    for step, loss in enumerate([0.3, 0.1, 0.4]):
        first.save(step, _state(step), metrics={"loss": loss})
    second = CheckpointManager(tmp_path, keep_latest=2, keep_best=1, best_metric="loss")
    assert second.all_steps() == [1, 2]
    assert second.best_step() == 1 and second.metrics(2) == {"loss": 0.4}
    second.save(3, _state(3), metrics={"loss": 0.5})
    assert second.all_steps() == [1, 2, 3]  # newest two (2, 3) and the best (1)


def test_saving_old_step_needs_overwrite_which_removes_newer(tmp_path):
    manager = CheckpointManager(tmp_path, keep_latest=5)
    for step in range(1, 5):
        manager.save(step, _state(step))
    with pytest.raises(ValueError, match=r"step 4 already exists.*overwrite=True"):
        manager.save(2, _state(-2))
    manager.save(2, _state(-2), overwrite=True)
    assert manager.all_steps() == [1, 2]
    np.testing.assert_array_equal(manager.restore(_state(0))["w"], np.full(4, -2.0))


def test_leftover_temporaries_are_removed_and_only_those(tmp_path):
    dead_pid = 2**22 + 12345  # above the kernel's pid_max default: no such process
    ours = f".checkpoint_3.safetensors.tmp-{dead_pid}-{'a' * 32}"
    live = f".checkpoint_4.safetensors.tmp-{os.getpid()}-{'b' * 32}"
    strangers = [
        "notes.txt",
        ".checkpoint_3.safetensors.tmp-me",
        "checkpoint_tmp",
        f".other_3.safetensors.tmp-{dead_pid}-{'c' * 32}",
    ]
    for name in [ours, live, *strangers]:
        (tmp_path / name).write_text("x")
    CheckpointManager(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted([live, *strangers])


def test_train_state_and_early_stopping_resume_together(tmp_path):
    model = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))
    state = TrainState.create(model=model, tx=optax.adam(1e-2))
    stopper = EarlyStopping(patience=2).update(0.5).update(0.7)
    with CheckpointManager(tmp_path, async_save=True) as manager:
        manager.save(1, (state, stopper), metrics={"val_loss": 0.7})
    fresh = (
        TrainState.create(model=eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(1)), tx=state.tx),
        EarlyStopping(patience=2),
    )
    restored_state, restored_stopper = CheckpointManager(tmp_path).restore(fresh)
    assert int(restored_stopper.patience_count) == 1
    assert float(restored_stopper.best_metric) == 0.5
    np.testing.assert_array_equal(restored_state.model.layers[0].weight, model.layers[0].weight)


# ---------------------------------------------------------------- async errors


def _fail_writes(monkeypatch):
    failed = threading.Event()

    def broken_write(fd, data):
        failed.set()
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(os, "write", broken_write)
    return failed


def test_async_failure_is_raised_by_next_save(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path, async_save=True)
    failed = _fail_writes(monkeypatch)
    manager.save(1, _state(1))
    assert failed.wait(30)
    # Once the failed save has ended (a save still being written would have the next one
    # queued behind it, its error raised at the save or wait after that):
    assert manager._async is not None  # async_save
    future = manager._async.save_future
    assert future is not None  # the failed save's
    concurrent.futures.wait([future], timeout=30)
    monkeypatch.undo()
    with pytest.raises(OSError, match="Read-only file system"):
        manager.save(2, _state(2))
    manager.save(2, _state(2))
    manager.wait()
    assert manager.all_steps() == [2]


def test_async_failure_is_raised_by_wait_and_by_close(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path, async_save=True)
    _fail_writes(monkeypatch)
    manager.save(1, _state(1))
    with pytest.raises(OSError, match="Read-only"):
        manager.wait()
    manager.save(2, _state(2))
    with pytest.raises(OSError, match="Read-only"):
        manager.close()


def test_context_manager_exit_waits_and_raises(tmp_path, monkeypatch):
    _fail_writes(monkeypatch)
    with pytest.raises(OSError, match="Read-only"):
        with CheckpointManager(tmp_path, async_save=True) as manager:
            manager.save(1, _state(1))


def test_async_save_snapshots_state_at_the_call(tmp_path):
    array = np.zeros(1 << 20, np.float32)
    with CheckpointManager(tmp_path, async_save=True) as manager:
        manager.save(1, {"a": array})
        array[:] = 1.0
    np.testing.assert_array_equal(CheckpointManager(tmp_path).restore({"a": array})["a"], 0.0)


# ---------------------------------------------------------------- SIGKILL


WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from eqx_train.checkpoints import CheckpointManager

    manager = CheckpointManager(sys.argv[1], keep_latest=2, keep_best=1, best_metric="loss")
    for step in range(1, 10_000):
        tree = {"step": np.asarray(step), "w": np.full((4, 1 << 20), step, np.float32)}
        manager.save(step, tree, metrics={"loss": 1.0 / step if step != 2 else 0.0})
        print(step, flush=True)
    """
)


@pytest.mark.slow
def test_sigkill_during_save_then_rerun_is_clean(tmp_path):
    run_then_sigkill(WRITER, str(tmp_path), after_line=4, delay=0.02)
    manager = CheckpointManager(tmp_path, keep_latest=2, keep_best=1, best_metric="loss")
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]
    steps = manager.all_steps()
    assert 2 in steps and manager.best_step() == 2
    latest = manager.latest_step()
    restored = manager.restore({"step": np.asarray(0), "w": np.zeros((4, 1 << 20), np.float32)})
    assert int(restored["step"]) == latest and np.all(restored["w"] == latest)


# ---------------------------------------------------------------- restore racing retention


@pytest.mark.parametrize("retention_after_read", [1, 2])
def test_restore_best_racing_the_trainers_retention_restores_the_new_best(
    tmp_path, monkeypatch, retention_after_read
):
    """The trainer's save (and its retention, which removes the old best) lands while the
    evaluator reads the metrics: after the first read, or after the last one."""
    trainer = CheckpointManager(tmp_path, keep_latest=1, keep_best=1, best_metric="loss")
    for step, loss in [(1, 0.5), (2, 0.1), (3, 0.3)]:
        trainer.save(step, _state(step), metrics={"loss": loss})
    assert trainer.all_steps() == [2, 3]
    evaluator = CheckpointManager(tmp_path, best_metric="loss", handle_sigterm=False)
    real = _retention.metadata_of
    reads, lock = [], threading.Lock()

    def racing(store, entry):
        metadata = real(store, entry)
        with lock:
            reads.append(entry)
            fire = len(reads) == retention_after_read
        if fire:
            trainer.save(4, _state(4), metrics={"loss": 0.05})  # the old best goes
        return metadata

    monkeypatch.setattr(_retention, "metadata_of", racing)
    restored = evaluator.restore(_state(0), step="best")
    assert trainer.all_steps() == [4]
    np.testing.assert_array_equal(restored["w"], np.full(4, 4.0))


def test_restore_best_while_a_trainer_saves_and_prunes_never_fails(tmp_path):
    trainer = CheckpointManager(tmp_path, keep_latest=1, keep_best=1, best_metric="loss")
    trainer.save(0, _state(0), metrics={"loss": 1.0})
    evaluator = CheckpointManager(tmp_path, best_metric="loss", handle_sigterm=False)
    done = threading.Event()
    losses = {0: 1.0}

    def train():
        try:
            for step in range(1, 60):
                losses[step] = 1.0 / (step + 1) if step % 3 else 2.0
                trainer.save(step, _state(step), metrics={"loss": losses[step]})
        finally:
            done.set()

    thread = threading.Thread(target=train)
    thread.start()
    restores = 0
    try:
        while not done.is_set() or restores == 0:
            restored = evaluator.restore(_state(-1), step="best")
            step = int(restored["w"][0])
            assert np.all(restored["w"] == step) and step in losses
            restores += 1
    finally:
        thread.join()
    assert restores > 0


# ---------------------------------------------------------- falling back from a corrupt latest


def test_restore_falls_back_to_the_newest_checkpoint_that_verifies_warning_of_the_bad_one(
    tmp_path,
):
    manager = CheckpointManager(tmp_path, keep_latest=3)
    for step in (1, 2, 3, 4):
        manager.save(step, _state(step))
    for step in (3, 4):
        flip_last_byte(tmp_path / f"checkpoint_{step}.safetensors")
    with pytest.warns(checkpoints.UnreadableCheckpointWarning) as caught:
        restored = manager.restore(_state(0))
    np.testing.assert_array_equal(restored["w"], np.full(4, 2.0))
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert "checkpoint_4.safetensors" in messages[0] and "checkpoint_3.safetensors" in messages[1]
    assert all("restored step 2" in m and "fallback=False" in m for m in messages)


def test_processes_skip_a_corrupt_checkpoint_only_once_they_all_agree(tmp_path, monkeypatch):
    """Two processes (the other one simulated in the exchange): this one finds the latest
    corrupt while the other saw it vanish (a concurrent overwrite), so the round counts as
    "gone" and both list again; this one must not skip it on its own, or their candidates
    would differ from then on. Next round both find it corrupt and move on together."""
    import json

    import jax

    from eqx_train.checkpoints.pipeline import _coordination

    manager = CheckpointManager(tmp_path, keep_latest=3, handle_sigterm=False)
    for step in (1, 2):
        manager.save(step, _state(step))
    flip_last_byte(tmp_path / "checkpoint_2.safetensors")
    latest = str(tmp_path / "checkpoint_2.safetensors")
    rounds = []

    def gather(op, value, **kwargs):
        path, _ = json.loads(value)
        rounds.append(path)
        if path == latest:
            other = "gone" if rounds.count(latest) == 1 else "corrupt: seen there too"
        else:
            other = "ok"
        return [value, json.dumps([path, other])]

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(_coordination, "gather", gather)
    # Process 0 (this one) moves the skipped checkpoint aside and tells the other.
    monkeypatch.setattr(_coordination, "decide", lambda op, decision, **kwargs: decision())
    with pytest.warns(checkpoints.UnreadableCheckpointWarning, match="checkpoint_2"):
        restored = manager.restore(_state(0))
    np.testing.assert_array_equal(restored["w"], np.full(4, 1.0))
    assert rounds == [latest, latest, str(tmp_path / "checkpoint_1.safetensors")]


def test_restore_fallback_false_raises_on_a_corrupt_latest(tmp_path):
    manager = CheckpointManager(tmp_path, keep_latest=2)
    manager.save(1, _state(1))
    manager.save(2, _state(2))
    flip_last_byte(tmp_path / "checkpoint_2.safetensors")
    with pytest.raises(checkpoints.CheckpointFormatError, match="checkpoint_2.safetensors"):
        manager.restore(_state(0), fallback=False)


def test_restore_of_a_requested_step_never_falls_back(tmp_path):
    manager = CheckpointManager(tmp_path, keep_latest=2, keep_best=1, best_metric="loss")
    manager.save(1, _state(1), metrics={"loss": 0.5})
    manager.save(2, _state(2), metrics={"loss": 0.1})
    flip_last_byte(tmp_path / "checkpoint_2.safetensors")
    with pytest.raises(checkpoints.CheckpointFormatError, match="checkpoint_2.safetensors"):
        manager.restore(_state(0), step=2)
    with pytest.raises(checkpoints.CheckpointFormatError, match="checkpoint_2.safetensors"):
        manager.restore(_state(0), step="best")


def test_restore_with_every_checkpoint_corrupt_names_them_all(tmp_path):
    manager = CheckpointManager(tmp_path, keep_latest=2)
    manager.save(1, _state(1))
    manager.save(2, _state(2))
    for step in (1, 2):
        flip_last_byte(tmp_path / f"checkpoint_{step}.safetensors")
    with pytest.raises(checkpoints.CheckpointFormatError, match="no checkpoint .* verifies") as e:
        manager.restore(_state(0))
    assert "checkpoint_1.safetensors" in str(e.value) and "checkpoint_2.safetensors" in str(e.value)


def test_restore_never_falls_back_over_a_target_mismatch(tmp_path):
    manager = CheckpointManager(tmp_path, keep_latest=2)
    manager.save(1, _state(1))
    manager.save(2, {"w": np.zeros(5, np.float32)})
    with pytest.raises(ValueError, match=r"checkpoint_2.*does not match the target"):
        manager.restore(_state(0))
