"""Worker for tests/test_coordination.py: one process of a 2-process jax.distributed job on
127.0.0.1.

    python coordination_worker.py MODE PROCESS_ID PORT

Mode "sections" runs every section that leaves both processes alive, in one job (starting
JAX twice per test would cost most of the suite's time), and prints "OK <section>
<process>" after each; a failing section raises (non-zero exit) and stops the job. The
"sigkill_*" modes kill process 1 and print "OK <mode> 0" on process 0.
"""

import collections
import json
import os
import signal
import sys
import threading
import time

mode, me, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

heartbeat_s = 100  # JAX's default
if mode in ("sigkill_short_heartbeat", "sigkill_recoverable"):
    heartbeat_s = 2  # short, to see what JAX does once it declares the killed peer dead
if mode == "sigkill_recoverable":
    jax.config.update("jax_enable_recoverability", True)
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=2,
    process_id=me,
    heartbeat_timeout_seconds=heartbeat_s,
)

from jax._src.distributed import global_state  # noqa: E402

from eqx_train.checkpoints._errors import calling  # noqa: E402
from eqx_train.checkpoints.pipeline import _coordination as co  # noqa: E402

_client = global_state.client
assert _client is not None  # jax.distributed is initialized above
client = _client  # the tests' own side channel, outside eqx_train's keys
SLACK_S = 1.5


def _named(name, run, *args, **kwargs):
    """`run(*args, **kwargs)` as the public call `name` (its errors name it)."""
    with calling(name):
        return run(*args, **kwargs)


def expect_timeout(run, timeout_s, *, naming):
    """Runs `run()`, which must raise BarrierTimeoutError naming processes `naming` within
    `timeout_s` + slack, leaving no new thread behind; returns the message."""
    threads = set(threading.enumerate())
    start = time.monotonic()
    try:
        run()
    except co.BarrierTimeoutError as error:
        elapsed = time.monotonic() - start
        message = str(error)
    else:
        raise AssertionError("the operation did not time out")
    assert elapsed < timeout_s + SLACK_S, elapsed
    assert f"processes {naming} did not arrive" in message, message
    assert set(threading.enumerate()) == threads, threading.enumerate()
    return message, elapsed


def eqx_keys():
    return [key for key, _ in client.key_value_dir_get("eqx_train/")]


def section_values():
    op = co.next_id("t")
    assert co.broadcast(op, f"from {me}", timeout_s=10) == "from 0"
    assert co.gather(co.next_id("t"), f"v{me}", timeout_s=10) == ["v0", "v1"]
    co.barrier(co.next_id("t"), timeout_s=10)
    # Values with separators, JSON and non-ASCII text cross unchanged.
    odd = ["", "a/b", '{"x": [1]}', "\n\t ü 🙂"][me::2]
    assert co.gather(co.next_id("t"), "|".join(odd), timeout_s=10) == [
        "|".join(["", '{"x": [1]}']),
        "|".join(["a/b", "\n\t ü 🙂"]),
    ]
    # decide: only process 0 decides, everyone gets its answer (of its type).
    calls = []

    def decision():
        calls.append(1)
        return me == 0

    assert co.decide(co.next_id("d"), decision, timeout_s=10) is True
    assert len(calls) == (1 if me == 0 else 0)
    assert co.decide(co.next_id("d"), lambda: f"p{me}", timeout_s=10) == "p0"


def section_decide_fails():
    def fail():
        raise OSError("disk full")

    start = time.monotonic()
    try:
        co.decide(co.next_id("d"), fail, timeout_s=30)
    except OSError as error:
        assert me == 0 and "disk full" in str(error)
    except RuntimeError as error:
        assert me == 1 and "process 0 failed to decide: OSError: disk full" in str(error), error
    else:
        raise AssertionError("decide did not raise")
    assert time.monotonic() - start < 5  # the peers learn of it at once, not at the timeout


def section_keys_bounded():
    peak, start = 0, time.monotonic()
    for n in range(1000):
        values = co.gather(co.next_id("many"), str(n), timeout_s=10)
        assert values == [str(n), str(n)], values
        if me == 0 and n % 50 == 49:
            peak = max(peak, sum(key.startswith("eqx_train/many/") for key in eqx_keys()))
    seconds = time.monotonic() - start
    co.barrier(co.next_id("other"), timeout_s=10)
    if me == 0:
        # Each kind keeps the keys of its last finished operation (2 arrivals and the
        # outcome) and of the next one, if process 1 has already started it.
        remaining = eqx_keys()
        ops = {"/".join(key.split("/")[:3]) for key in remaining}  # eqx_train/KIND/N
        per_kind = collections.Counter(op.split("/")[1] for op in ops)
        assert peak <= 6 and max(per_kind.values()) <= 2, (peak, remaining)
        assert len(remaining) <= 3 * len(per_kind) + 3, remaining
        print(
            "KEYS",
            json.dumps({"peak": peak, "remaining": remaining, "seconds": seconds}),
            flush=True,
        )


def section_late():
    failed_op, next_op = co.next_id("t"), co.next_id("t")
    if me == 0:
        message, elapsed = expect_timeout(
            lambda: _named("save_test", co.barrier, failed_op, timeout_s=2), 2, naming=[1]
        )
        assert elapsed >= 2, elapsed
        for part in (failed_op, "save_test", "2s", "process 0 waited"):
            assert part in message, (part, message)
        client.key_value_set("test/zero_gave_up", "")
        # Process 1 now arrives at the failed operation, then at this one.
        assert co.gather(next_op, "zero", timeout_s=20) == ["zero", "one"]
        client.blocking_key_value_get("test/one_raised", 1000)
    else:
        client.blocking_key_value_get("test/zero_gave_up", 20_000)
        start = time.monotonic()
        message, _ = expect_timeout(
            lambda: _named("save_test", co.barrier, failed_op, timeout_s=20), 20, naming=[1]
        )
        # It learns of the failure at once, and that it came too late.
        assert time.monotonic() - start < 2 and "Process 1 itself arrived after" in message
        client.key_value_set("test/one_raised", "")
        assert co.gather(next_op, "one", timeout_s=20) == ["zero", "one"]


def section_preemption():
    co.barrier(co.next_id("t"), timeout_s=20)
    for step in range(1000):
        if me == 0 and step == 20:
            os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's preemption notice
        if co.reached_preemption(step):
            print(f"PREEMPTED AT {step}", flush=True)
            break
        time.sleep(0.01)
    else:
        raise AssertionError("the preemption sync point was never reached")


def sigkill():
    co.barrier(co.next_id("t"), timeout_s=20)
    op = co.next_id("t")
    if me == 1:
        client.blocking_key_value_get("test/zero_waits", 20_000)
        time.sleep(0.3)  # process 0 is inside its wait now
        os.kill(os.getpid(), signal.SIGKILL)
    client.key_value_set("test/zero_waits", "")
    # sigkill_short_heartbeat: JAX declares process 1 dead after ~2s and ends this process
    # before the 30s timeout; the other modes see our own timeout first.
    timeout_s = 30 if mode == "sigkill_short_heartbeat" else 4
    message, _ = expect_timeout(
        lambda: co.gather(op, "zero", timeout_s=timeout_s), timeout_s, naming=[1]
    )
    print("RAISED", message, flush=True)
    if mode == "sigkill_recoverable":
        time.sleep(heartbeat_s)  # process 1 died 3 heartbeat timeouts ago by now
        client.key_value_set("test/still_here", "")
    print(f"OK {mode} {me}", flush=True)
    os._exit(0)  # the peer is gone: skip the shutdown handshake with it


# Preemption last: after its sync point, JAX's preemption service has done its one job.
SECTIONS = [section_values, section_decide_fails, section_late, section_keys_bounded]
SECTIONS.append(section_preemption)

if mode == "sections":
    for section in SECTIONS:
        section()
        print(f"OK {section.__name__.removeprefix('section_')} {me}", flush=True)
elif mode in ("sigkill_default", "sigkill_short_heartbeat", "sigkill_recoverable"):
    sigkill()
else:
    raise ValueError(f"unknown mode {mode}")

jax.distributed.shutdown()
