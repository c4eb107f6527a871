"""Multi-process coordination on JAX's coordination service (eqx_train/checkpoints/
_coordination.py): in this process (one process, no jax.distributed) and in 2 real
jax.distributed processes on 127.0.0.1 (tests/support/coordination_worker.py)."""

import os
import re
import signal
import sys
import time

import jax
import pytest

from eqx_train.checkpoints.pipeline import _coordination as co
from tests.support.helpers import SUPPORT, free_port, run_processes, worker_env

WORKER = os.path.join(SUPPORT, "coordination_worker.py")
TIMEOUT_S = 60


def _run_pair(mode):
    """Runs the 2 processes of `mode`; returns [(returncode, output), ...] by process."""
    port = str(free_port())
    env = worker_env()
    return run_processes(
        [([sys.executable, WORKER, mode, str(i), port], env) for i in range(2)], TIMEOUT_S
    )


def _assert_ok(mode, results, processes=(0, 1)):
    for i in processes:
        returncode, out = results[i]
        assert f"OK {mode} {i}" in out, f"process {i} exited {returncode}:\n{out[-3000:]}"


# ------------------------------------------------------------------- one process, no service


def test_single_process_collectives_return_the_local_value_without_jax_distributed():
    assert jax.process_count() == 1
    op = co.next_id("single")
    assert co.broadcast(op, "x", timeout_s=1) == "x"
    assert co.gather(co.next_id("single"), "y", timeout_s=1) == ["y"]
    co.barrier(co.next_id("single"), timeout_s=1)
    assert co.decide(co.next_id("single"), lambda: True, timeout_s=1) is True
    assert co.decide(co.next_id("single"), lambda: "later", timeout_s=1) == "later"


def test_reached_preemption_is_false_without_jax_distributed():
    assert co.reached_preemption(0) is False


def test_next_id_counts_per_kind():
    first = co.next_id("counted")
    assert co.next_id("other_kind").startswith("eqx_train/other_kind/")
    second = co.next_id("counted")
    n = int(first.rpartition("/")[2])
    assert (first, second) == (f"eqx_train/counted/{n}", f"eqx_train/counted/{n + 1}")


@pytest.mark.parametrize("kind", ["", "a/b", "save/0"])
def test_next_id_rejects_kinds_that_could_nest_in_another_id(kind):
    with pytest.raises(ValueError, match="without '/'"):
        co.next_id(kind)


def test_broadcast_on_process_0_needs_a_value():
    with pytest.raises(ValueError, match="process 0 must give the value"):
        co.broadcast(co.next_id("single"), None, timeout_s=1)


def test_decide_rejects_a_decision_that_is_not_bool_or_str(without_type_checks):
    with pytest.raises(TypeError, match="must be a bool or a str, got int 1"):
        co.decide(co.next_id("single"), lambda: 1, timeout_s=1)  # type: ignore


def test_several_processes_without_the_coordination_client_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(RuntimeError, match="process_count.. is 2 but the client of JAX's"):
        co.barrier(co.next_id("single"), timeout_s=1)


# ---------------------------------------------------------------- 2 jax.distributed processes


@pytest.fixture(scope="module")
def sections():
    """One job of 2 processes runs every section that leaves both alive (a job per test
    would spend most of the suite's time starting JAX): {process: output}."""
    return {i: out for i, (_, out) in enumerate(_run_pair("sections"))}


def _assert_section(sections, name):
    for i, out in sections.items():
        assert f"OK {name} {i}" in out, f"process {i}, section {name}:\n{out[-3000:]}"


@pytest.mark.slow
def test_broadcast_gather_barrier_and_decide_across_two_processes(sections):
    _assert_section(sections, "values")


@pytest.mark.slow
def test_decide_failing_on_process_0_fails_every_process_at_once(sections):
    _assert_section(sections, "decide_fails")


@pytest.mark.slow
def test_peer_that_never_arrives_times_out_by_name_and_a_late_arrival_fails_too(sections):
    """Process 0 gives up on process 1 within the timeout, with no thread left behind;
    process 1, arriving afterwards, fails at once instead of succeeding alone; the next
    operation is not satisfied by the failed one's keys."""
    _assert_section(sections, "late")


@pytest.mark.slow
def test_keys_stay_bounded_over_a_thousand_operations(sections):
    _assert_section(sections, "keys_bounded")


@pytest.mark.slow
def test_sigterm_on_process_0_makes_both_reach_the_preemption_point_at_one_step(sections):
    _assert_section(sections, "preemption")
    steps = [re.findall(r"PREEMPTED AT (\d+)", out) for out in sections.values()]
    assert steps[0] == steps[1] and len(steps[0]) == 1, steps
    assert int(steps[0][0]) > 20  # after the step of the notice


@pytest.mark.slow
def test_peer_killed_mid_wait_is_named_in_the_timeout_error():
    results = _run_pair("sigkill_default")
    _assert_ok("sigkill_default", results, processes=(0,))
    assert results[1][0] == -signal.SIGKILL


@pytest.mark.slow
def test_jax_ends_survivors_at_its_heartbeat_timeout_unless_recoverability_is_on():
    """Measured JAX behaviour the docs rely on: once the coordination service declares a
    killed peer dead (after `heartbeat_timeout_seconds`), JAX aborts every survivor, before a
    longer timeout of ours fires; with `jax_enable_recoverability` the survivors live on."""
    start = time.monotonic()
    results = _run_pair("sigkill_short_heartbeat")
    returncode, out = results[0]
    assert returncode == -signal.SIGABRT, f"exited {returncode}:\n{out[-3000:]}"
    assert "the JAX distributed service detected fatal errors" in out
    assert "RAISED" not in out  # our 30s timeout never fired
    assert time.monotonic() - start < 25
    results = _run_pair("sigkill_recoverable")
    _assert_ok("sigkill_recoverable", results, processes=(0,))
