"""CheckpointManager's save policies: `should_save` by step interval, by time (process 0's
clock), on preemption (SIGTERM in a real process, JAX's sync point), and never for a step
already saved; the SIGTERM handler is chained and put back."""

import os
import random
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints import CheckpointManager
from eqx_train.checkpoints._errors import call
from eqx_train.checkpoints.manager import _manager
from eqx_train.checkpoints.pipeline import _coordination
from tests.support.helpers import ROOT, SUPPORT, latest_path, xla_flags

WORKER = os.path.join(SUPPORT, "policies_worker.py")


def _state(step):
    return {"w": np.full(2, step, np.float32)}


def _run(manager, steps):
    """The documented loop: the steps `should_save` said yes to (all of them saved)."""
    saved = []
    for step in steps:
        if manager.should_save(step):
            manager.save(step, _state(step))
            saved.append(step)
    return saved


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(_manager, "_clock", fake)
    return fake


@pytest.fixture
def sigterm_guard():
    """A recording Python SIGTERM handler for the test's duration, so that a signal the
    manager failed to catch is recorded instead of killing pytest; puts back the original."""
    received = []
    original = signal.getsignal(signal.SIGTERM)

    def guard(signum, frame):
        received.append(signum)

    signal.signal(signal.SIGTERM, guard)
    try:
        yield guard, received
    finally:
        signal.signal(signal.SIGTERM, original)


# ---------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"save_interval_steps": 0}, "save_interval_steps must be an int >= 1.*got 0"),
        ({"save_interval_steps": -5}, "save_interval_steps must be an int >= 1.*got -5"),
        ({"save_interval_seconds": 0}, "save_interval_seconds must be a finite number > 0"),
        ({"save_interval_seconds": -1.5}, r"save_interval_seconds .* got -1\.5"),
        ({"save_interval_seconds": float("inf")}, "save_interval_seconds .* got inf"),
        ({"save_interval_seconds": float("nan")}, "save_interval_seconds .* got nan"),
    ],
)
def test_interval_options_are_validated_eagerly(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        CheckpointManager(tmp_path, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"save_interval_steps": 2.0}, r"save_interval_steps must be an int >= 1.*got 2\.0"),
        ({"save_interval_steps": True}, "save_interval_steps must be an int >= 1.*got True"),
        ({"save_interval_seconds": "60"}, "save_interval_seconds .* got '60'"),
        ({"save_interval_seconds": True}, "save_interval_seconds .* got True"),
        ({"handle_sigterm": "yes"}, "handle_sigterm must be True or False, got 'yes'"),
    ],
)
def test_wrongly_typed_policy_options_are_refused_naming_them(
    tmp_path, kwargs, message, without_type_checks
):
    with pytest.raises(ValueError, match=message):
        CheckpointManager(tmp_path, **kwargs)


def test_should_save_rejects_a_bad_step(tmp_path):
    manager = CheckpointManager(tmp_path, save_interval_steps=2, handle_sigterm=False)
    with pytest.raises(ValueError, match="should_save: step must be finite"):
        manager.should_save(float("nan"))
    with pytest.raises(ValueError, match="should_save: step must be >= 0"):
        manager.should_save(-2)


# ---------------------------------------------------------------- step interval


def test_step_interval_says_yes_at_its_multiples(tmp_path):
    manager = CheckpointManager(tmp_path, keep_latest=10, save_interval_steps=3)
    assert _run(manager, range(11)) == [0, 3, 6, 9]
    assert manager.all_steps() == [0, 3, 6, 9]


def test_step_interval_with_float_steps_counts_values(tmp_path):
    manager = CheckpointManager(tmp_path, keep_latest=10, save_interval_steps=2)
    assert _run(manager, [0.5, 1.0, 1.5, 2.0, 3.0, 4.0]) == [2.0, 4.0]


def test_without_intervals_only_a_preemption_says_yes(tmp_path, clock):
    manager = CheckpointManager(tmp_path, handle_sigterm=False)
    clock.now += 10**9
    assert _run(manager, range(50)) == []


# ---------------------------------------------------------------- time interval


def test_time_interval_counts_from_creation(tmp_path, clock):
    manager = CheckpointManager(tmp_path, save_interval_seconds=60)
    clock.now += 59.9
    assert not manager.should_save(0)
    clock.now += 0.1
    assert manager.should_save(1)


def test_time_interval_counts_from_when_the_last_save_began(tmp_path, clock, monkeypatch):
    manager = CheckpointManager(tmp_path, save_interval_seconds=60)
    clock.now += 60
    began = clock.now
    real_save = _manager.save_pipeline

    def slow_save(*args, **kwargs):
        clock.now += 25  # the save itself takes 25 s
        return real_save(*args, **kwargs)

    monkeypatch.setattr(_manager, "save_pipeline", slow_save)
    assert _run(manager, [1]) == [1]
    clock.now = began + 59
    assert not manager.should_save(2)
    clock.now = began + 60
    assert manager.should_save(3)


def test_a_step_interval_save_restarts_the_clock(tmp_path, clock):
    manager = CheckpointManager(tmp_path, save_interval_steps=10, save_interval_seconds=60)
    clock.now += 50
    assert _run(manager, [10]) == [10]  # by the step interval
    clock.now += 50  # 100 s since creation, 50 s since the save
    assert not manager.should_save(11)
    clock.now += 10
    assert manager.should_save(12)


def test_time_policy_ignores_saves_that_failed(tmp_path, clock, without_type_checks):
    manager = CheckpointManager(tmp_path, save_interval_seconds=60)
    clock.now += 60
    with pytest.raises(TypeError, match="metric 'loss' must be a number"):
        manager.save(1, _state(1), metrics={"loss": "low"})  # pyright: ignore[reportArgumentType]  # a wrong value on purpose
    assert manager.all_steps() == []
    assert manager.should_save(1)


# ---------------------------------------------------------------- already saved


def test_never_says_yes_for_a_step_already_saved(tmp_path, clock):
    manager = CheckpointManager(tmp_path, save_interval_steps=1, save_interval_seconds=1)
    manager.save(5, _state(5))
    clock.now += 10**6
    assert [manager.should_save(step) for step in [3, 4, 5, 5.0, 5.5, 6]] == [
        False,
        False,
        False,
        False,
        True,
        True,
    ]


def test_a_new_manager_sees_the_steps_already_in_the_directory(tmp_path):
    CheckpointManager(tmp_path).save(7, _state(7))
    resumed = CheckpointManager(tmp_path, save_interval_steps=1)
    assert [resumed.should_save(step) for step in range(6, 10)] == [False, False, True, True]


def test_overwriting_an_older_step_makes_it_the_latest(tmp_path):
    manager = CheckpointManager(tmp_path, keep_latest=5, save_interval_steps=1)
    _run(manager, range(5))
    manager.save(2, _state(-2), overwrite=True)
    assert manager.all_steps() == [0, 1, 2]
    assert [manager.should_save(step) for step in [2, 3]] == [False, True]


# ---------------------------------------------------------------- process 0 decides


def test_should_save_is_decided_by_process_0_through_coordination(tmp_path, monkeypatch):
    """Every process calls `decide`; only process 0 runs the decision, and every process
    returns what process 0 decided (here a stand-in process 0 says the opposite)."""
    calls = []

    def decide(op, make_decision, *, timeout_s):
        calls.append((op, call(), timeout_s, make_decision()))
        return "save" if len(calls) == 1 else "preempted, save"

    monkeypatch.setattr(_coordination, "decide", decide)
    manager = CheckpointManager(
        tmp_path, save_interval_steps=100, timeout_s=12, handle_sigterm=False
    )
    assert manager.should_save(1) and not manager.preempted
    assert manager.should_save(2) and manager.preempted
    (op1, caller, timeout, local), (op2, *_) = calls
    assert caller == "CheckpointManager.should_save" and timeout == 12
    assert local == "skip"  # what this process would have said on its own
    assert op1 != op2  # each call is its own exchange


def test_jax_preemption_sync_point_is_asked_every_call_and_saves_that_step(tmp_path, monkeypatch):
    asked = []

    def reached_preemption(step):
        asked.append(step)
        return step == 7

    monkeypatch.setattr(_coordination, "reached_preemption", reached_preemption)
    manager = CheckpointManager(tmp_path, save_interval_steps=100, handle_sigterm=False)
    saved = []
    step = 0
    for step in range(1, 20):
        if manager.should_save(step):
            manager.save(step, _state(step))
            saved.append(step)
        if manager.preempted:
            break
    assert saved == [7] and step == 7
    assert asked == list(range(1, 8))
    assert all(type(s) is int for s in asked)


def test_preemption_is_reported_even_when_the_step_is_already_saved(tmp_path, monkeypatch):
    monkeypatch.setattr(_coordination, "reached_preemption", lambda step: step == 3)
    manager = CheckpointManager(tmp_path, handle_sigterm=False)
    manager.save(3, _state(3))
    assert not manager.should_save(3)
    assert manager.preempted  # the loop still leaves: step 3 is already safe


# ---------------------------------------------------------------- SIGTERM in this process


def test_no_handler_until_should_save_is_called(tmp_path, sigterm_guard):
    guard, _ = sigterm_guard
    manager = CheckpointManager(tmp_path, save_interval_steps=10)
    manager.save(1, _state(1))
    assert signal.getsignal(signal.SIGTERM) is guard
    manager.should_save(2)
    assert signal.getsignal(signal.SIGTERM) is not guard
    manager.close()
    assert signal.getsignal(signal.SIGTERM) is guard


def test_sigterm_makes_the_next_should_save_say_yes_and_chains(tmp_path, sigterm_guard):
    guard, received = sigterm_guard
    with CheckpointManager(tmp_path, save_interval_steps=100) as manager:
        assert not manager.should_save(1) and not manager.preempted
        os.kill(os.getpid(), signal.SIGTERM)
        assert received == [signal.SIGTERM]  # the previous handler still ran
        assert not manager.preempted  # not before should_save has seen it
        assert manager.should_save(2) and manager.preempted
        manager.save(2, _state(2))
        assert not manager.should_save(2)
        assert manager.preempted
    assert signal.getsignal(signal.SIGTERM) is guard
    assert latest_path(tmp_path).endswith("checkpoint_2.safetensors")


def test_handle_sigterm_false_never_touches_signals(tmp_path, sigterm_guard):
    guard, _ = sigterm_guard
    with CheckpointManager(tmp_path, save_interval_steps=1, handle_sigterm=False) as manager:
        manager.should_save(1)
        assert signal.getsignal(signal.SIGTERM) is guard


def test_no_handler_is_installed_from_another_thread(tmp_path, sigterm_guard):
    guard, _ = sigterm_guard
    manager = CheckpointManager(tmp_path, save_interval_steps=1)
    answers = []
    thread = threading.Thread(target=lambda: answers.append(manager.should_save(1)))
    thread.start()
    thread.join()
    assert answers == [True]
    assert signal.getsignal(signal.SIGTERM) is guard


def test_close_leaves_a_handler_installed_over_ours(tmp_path, sigterm_guard):
    manager = CheckpointManager(tmp_path)
    manager.should_save(1)

    def later(signum, frame):
        pass

    signal.signal(signal.SIGTERM, later)
    manager.close()
    assert signal.getsignal(signal.SIGTERM) is later


def test_nested_managers_put_handlers_back_in_order(tmp_path, sigterm_guard):
    guard, received = sigterm_guard
    with CheckpointManager(tmp_path / "a") as outer:
        outer.should_save(1)
        outer_handler = signal.getsignal(signal.SIGTERM)
        with CheckpointManager(tmp_path / "b") as inner:
            inner.should_save(1)
            os.kill(os.getpid(), signal.SIGTERM)
            assert inner.should_save(2) and outer.should_save(2)  # both heard it
        assert signal.getsignal(signal.SIGTERM) is outer_handler
    assert signal.getsignal(signal.SIGTERM) is guard
    assert received == [signal.SIGTERM]


@pytest.mark.parametrize("close_order", ["creation", "reverse"])
def test_sigterm_reaches_exactly_the_live_managers_whatever_the_close_order(
    tmp_path, sigterm_guard, close_order
):
    guard, received = sigterm_guard
    first = CheckpointManager(tmp_path / "a")
    second = CheckpointManager(tmp_path / "b")
    first.should_save(1)
    second.should_save(1)
    closing, staying = (first, second) if close_order == "creation" else (second, first)
    closing.close()
    os.kill(os.getpid(), signal.SIGTERM)
    assert received == [signal.SIGTERM]  # the handler before the managers still runs
    assert staying.should_save(2) and staying.preempted  # the live one heard it
    staying.close()
    # Both closed: the original handler is back, and SIGTERM means what it meant before.
    assert signal.getsignal(signal.SIGTERM) is guard
    os.kill(os.getpid(), signal.SIGTERM)
    assert received == [signal.SIGTERM, signal.SIGTERM]


def test_a_closed_manager_is_not_told_of_a_later_sigterm(tmp_path, sigterm_guard):
    first = CheckpointManager(tmp_path / "a", save_interval_steps=100)
    second = CheckpointManager(tmp_path / "b", save_interval_steps=100)
    first.should_save(1)
    second.should_save(1)
    first.close()
    os.kill(os.getpid(), signal.SIGTERM)
    assert not first.should_save(3) and not first.preempted
    assert second.should_save(3) and second.preempted
    first.close()
    second.close()


def test_a_manager_reopened_after_all_closed_installs_the_handler_again(tmp_path, sigterm_guard):
    guard, received = sigterm_guard
    for run in range(2):
        with CheckpointManager(tmp_path / str(run), save_interval_steps=100) as manager:
            manager.should_save(1)
            assert signal.getsignal(signal.SIGTERM) is not guard
            os.kill(os.getpid(), signal.SIGTERM)
            assert manager.should_save(2)
        assert signal.getsignal(signal.SIGTERM) is guard
    assert received == [signal.SIGTERM, signal.SIGTERM]


# ---------------------------------------------------------------- SIGTERM, real process


def _start_worker(directory, steps):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags()}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, WORKER, str(directory), str(steps)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.mark.slow
def test_sigterm_mid_loop_saves_that_step_exits_0_and_the_next_run_resumes(tmp_path):
    total = 100_000
    signal_after = random.randint(5, 40)
    process = _start_worker(tmp_path, total)
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if line.strip().isdigit() and int(line) >= signal_after:
                process.send_signal(signal.SIGTERM)
                break
        rest, errors = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, errors
    last = rest.strip().splitlines()[-1]
    assert last.startswith("preempted "), rest
    preempted_at = int(last.split()[1])
    assert signal_after <= preempted_at < total - 1  # it landed mid-loop
    assert checkpoints.available_steps(tmp_path) == [preempted_at]  # only the preemption save
    fresh = {"step": np.asarray(-1), "w": np.zeros(4, np.float32)}
    restored = checkpoints.restore_checkpoint(tmp_path, fresh)
    assert int(restored["step"]) == preempted_at
    np.testing.assert_array_equal(restored["w"], np.full(4, preempted_at + 1))

    resumed = _start_worker(tmp_path, preempted_at + 4)
    out, errors = resumed.communicate(timeout=60)
    assert resumed.returncode == 0, errors
    assert out.splitlines() == [
        f"resumed {preempted_at}",
        *(str(preempted_at + i) for i in (1, 2, 3)),
        f"finished {preempted_at + 3}",
    ]
    restored = checkpoints.restore_checkpoint(tmp_path, fresh)
    np.testing.assert_array_equal(restored["w"], np.full(4, preempted_at + 4))
