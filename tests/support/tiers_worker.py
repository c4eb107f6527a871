"""Worker for tests/test_checkpoint_tiers_multiprocess.py: one JAX process (one CPU device)
of a loopback job whose state is sharded across the processes.

    python tiers_worker.py MODE PROCESS_ID NUM_PROCESSES PORT BASE

The persistent tier is BASE/persistent, this process's local tier BASE/local_<process>.
Prints "OK <mode> <process>" and a "RESTORED <json>" line; any failure is an exception.
"""

import json
import os
import signal
import sys
import time

mode, pid, count, port, base = (
    sys.argv[1],
    int(sys.argv[2]),
    int(sys.argv[3]),
    sys.argv[4],
    sys.argv[5],
)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

try:  # the peer copies travel over a collective, over gloo on CPU
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
except AttributeError:  # a JAX without the option, where gloo is the only choice
    pass
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=count,
    process_id=pid,
    # kill_mid_transfer: the survivors wait inside the collective until the service declares
    # the killed process dead and ends them.
    heartbeat_timeout_seconds=10 if mode == "kill_mid_transfer" else 100,
)

from eqx_train.checkpoints import CheckpointManager  # noqa: E402
from eqx_train.checkpoints.manager import _manager, _tiers  # noqa: E402
from eqx_train.checkpoints.pipeline import _local_tier, _restore  # noqa: E402

PERSISTENT = os.path.join(base, "persistent")
LOCAL = os.path.join(base, f"local_{pid}")
STEPS = 6  # local every step, persistent every 2: local 5, persistent 4
KILL_AT = 3  # kill_mid_save: process 1 dies inside its unit's write of this step


def values(step):
    """Independent of the process count: the global array and a host-local leaf (the same
    on every process: what differs per process is its host_state)."""
    return np.arange(8 * 4, dtype=np.float32).reshape(8, 4) * (step + 1), np.full(3, step, np.int64)


def state(step):
    mesh = Mesh(np.array(jax.devices()), ("d",))
    w, own = values(step)
    sharded = jax.make_array_from_callback(w.shape, NamedSharding(mesh, P("d")), lambda i: w[i])
    return {"w": sharded, "own": own, "n": step}


def manager(**kwargs):
    return CheckpointManager(
        PERSISTENT,
        local_directory=LOCAL,
        local_interval_steps=1,
        save_interval_steps=2,
        timeout_s=kwargs.pop("timeout_s", 60),
        **kwargs,
    )


def check(tree, step):
    w, own = values(step)
    for shard in tree["w"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), w[shard.index], strict=True)
    np.testing.assert_array_equal(tree["own"], own, strict=True)
    assert tree["n"] == step, tree["n"]


def report(mgr, tree):
    last = mgr.last_restore
    print(
        "RESTORED "
        + json.dumps(
            {
                "step": last.step,
                "tier": last.tier,
                "host_state": last.host_state,
                "bytes_read": last.bytes_read,
                "seconds": last.seconds,
                "n": tree["n"],
            }
        ),
        flush=True,
    )
    check(tree, last.step)
    assert last.host_state == {"process": pid, "step": last.step}, last.host_state


def save(steps=STEPS, **kwargs):
    with manager(**kwargs) as mgr:
        for step in range(steps):
            if mgr.should_save(step):
                mgr.save(step, state(step), host_state={"process": pid, "step": step})


def forbid_persistent_reads():
    def refuse(*args, **kwargs):
        raise AssertionError("the persistent tier was read")

    _manager.restore_entry = refuse
    _restore.restore = refuse


def hook_kill():
    """Process 1 dies inside the write of its own unit at step KILL_AT, half of it written."""
    real = _local_tier.write_all

    def write_half_then_die(fd, data):
        if f"checkpoint_{KILL_AT}.local" in os.readlink(f"/proc/self/fd/{fd}"):
            real(fd, data[: len(data) // 2])
            os.fsync(fd)
            print("KILLED MID-WRITE", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        real(fd, data)

    _local_tier.write_all = write_half_then_die


def hook_kill_in_transfer():
    """Process 1 dies as the peer transfer of step KILL_AT begins (the others are inside
    the collective)."""
    real = _tiers._peers.shift_bytes
    calls = []

    def die_at_kill_step(payload, shift, sizes):
        calls.append(shift)
        if len(calls) > KILL_AT:  # one transfer per save (peer_replicas=1)
            print("KILLED MID-TRANSFER", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(payload, shift, sizes)

    _tiers._peers.shift_bytes = die_at_kill_step


if mode == "save":
    save()
elif mode == "save_async":
    save(async_save=True)
elif mode == "kill_mid_save":
    if pid == 1:
        hook_kill()
    try:
        save(steps=KILL_AT + 1, timeout_s=20)
    except Exception as error:  # the survivors: their commit exchange times out
        print(f"SURVIVED {type(error).__name__}", flush=True)
    print(f"OK {mode} {pid}", flush=True)
    # Process 0 hosts the coordination service: were it to exit first, a survivor still
    # waiting on an exchange would lose the service and abort. It stays until every
    # survivor has said OK.
    open(os.path.join(base, f"ok_{pid}"), "w").close()
    survivors = [os.path.join(base, f"ok_{i}") for i in range(count) if i != 1]
    deadline = time.monotonic() + 120
    while pid == 0 and time.monotonic() < deadline and not all(map(os.path.exists, survivors)):
        time.sleep(0.05)
    os._exit(0)  # jax.distributed's shutdown would wait for the dead process
elif mode == "kill_mid_transfer":
    if pid == 1:
        hook_kill_in_transfer()
    save(steps=KILL_AT + 1, timeout_s=20)
    raise SystemExit("the save of step KILL_AT returned")
elif mode in ("restore_local", "restore_any"):
    if mode == "restore_local":
        forbid_persistent_reads()
    mgr = manager()
    report(mgr, mgr.restore(state(0)))
elif mode == "restore_persistent":
    mgr = manager()
    tree = mgr.restore(state(0))
    report(mgr, tree)
    assert mgr.last_restore is not None and mgr.last_restore.tier == "persistent"
else:
    raise SystemExit(f"unknown mode {mode}")
print(f"OK {mode} {pid}", flush=True)
