"""A training run that resumes from its checkpoints, for tests/test_resume_exactly.py.

    python -m tests.support.resume_worker WORKDIR TRACK OUT [KILL_AT]

Trains `STEPS` steps of a dropout MLP on 8 CPU devices (`TRACK` is `mesh`: `jit_step` over a
Mesh, or `pmap`: `pmap_step` over replicas), shuffling and adding noise with a NumPy
Generator, updating EarlyStopping, and saving the whole carry (state, dropout key, NumPy
generator, data position, this epoch's order, every loss so far) to WORKDIR every
`SAVE_EVERY` steps. It first restores the newest checkpoint in WORKDIR, if any, and prints
`start <position>`. When it finishes it saves the final carry to OUT.

With `KILL_AT`, the save of that step stops inside its write, after the temporary file's
bytes are written and before it is fsynced and renamed: the worker prints `in-save <step>`
and waits for a line on stdin that never comes, so the parent's SIGKILL lands mid-save.
"""

from __future__ import annotations

import os
import stat
import sys

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import eqx_train  # noqa: E402
from eqx_train import checkpoints  # noqa: E402
from eqx_train.checkpoints import CheckpointManager  # noqa: E402

STEPS, SAVE_EVERY, BATCH = 12, 2, 16
DATA_X = np.random.default_rng(0).normal(size=(80, 4)).astype(np.float32)  # 5 batches
DATA_Y = DATA_X.sum(axis=1, keepdims=True)
BATCHES_PER_EPOCH = len(DATA_X) // BATCH


class Net(eqx.Module):
    hidden: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.hidden = eqx.nn.Linear(4, 32, key=k1)
        self.dropout = eqx.nn.Dropout(0.2)
        self.out = eqx.nn.Linear(32, 1, key=k2)

    def __call__(self, x, key):
        return self.out(self.dropout(jax.nn.relu(self.hidden(x)), key=key))


def fresh_carry() -> dict:
    state = eqx_train.TrainState.create(model=Net(jax.random.key(0)), tx=optax.adam(1e-2))
    return {
        "state": state,
        "stopper": eqx_train.EarlyStopping(min_delta=1e-3, patience=3),
        "key": jax.random.key(1),
        "rng": eqx_train.numpy_rng_state(np.random.default_rng(2)),
        "position": np.int64(0),
        "order": np.arange(len(DATA_X)),
        "losses": np.zeros(STEPS, np.float32),
    }


def loss_fn(model, x, y, key):
    keys = jax.random.split(key, len(x))
    return jnp.mean((jax.vmap(model)(x, keys) - y) ** 2)


def mesh_track(static):
    mesh = Mesh(np.array(jax.devices()), ("batch",))

    def step_fn(state, x, y, key):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(state.model, x, y, key)
        return state.apply_gradients(grads=grads), loss

    step = eqx_train.jit_step(step_fn, static, has_aux=True)

    def run(arrays, x, y, key):
        x, y = eqx_train.shard_to_mesh((x, y), mesh)
        return step(arrays, x, y, jax.device_put(key, NamedSharding(mesh, P())))

    return (
        lambda arrays: jax.device_put(arrays, NamedSharding(mesh, P())),
        run,
        lambda arrays: arrays,
        jax.device_get,
    )


def pmap_track(static):
    def step_fn(state, x, y, key):
        key = jax.random.fold_in(key, jax.lax.axis_index("batch"))
        loss, grads = eqx.filter_value_and_grad(loss_fn)(state.model, x, y, key)
        grads, loss = eqx_train.pmean((grads, loss), "batch")
        return state.apply_gradients(grads=grads), loss

    step = eqx_train.pmap_step(step_fn, static, has_aux=True)

    def run(replicated, x, y, key):
        return step(replicated, *eqx_train.shard((x, y)), eqx_train.replicate(key))

    return (
        eqx_train.replicate,
        run,
        eqx_train.unreplicate,
        lambda loss: jax.device_get(eqx_train.unreplicate(loss)),
    )


def arm_kill_in_save() -> list[bool]:
    """Replaces `os.fsync` with one that, while armed, stops at the fsync of a regular file
    (the temporary checkpoint file, all its bytes written) and waits to be killed."""
    armed = [False]
    real_fsync = os.fsync

    def fsync(fd):
        if armed[0] and stat.S_ISREG(os.fstat(fd).st_mode):
            print(f"in-save {position_saved[0]}", flush=True)
            sys.stdin.readline()  # the parent never writes: it kills this process
            raise SystemExit("resume_worker: was not killed")
        return real_fsync(fd)

    os.fsync = fsync
    return armed


position_saved = [0]


def main() -> None:
    workdir, track, out = sys.argv[1:4]
    kill_at = int(sys.argv[4]) if len(sys.argv) > 4 else None
    armed = arm_kill_in_save() if kill_at is not None else [False]
    manager = CheckpointManager(workdir, keep_latest=2, handle_sigterm=False)
    carry = manager.restore(fresh_carry())
    arrays, static = eqx.partition(carry["state"], eqx.is_array)
    place, run, one_copy, one_loss = (mesh_track if track == "mesh" else pmap_track)(static)
    arrays = place(arrays)
    rng = eqx_train.numpy_rng_from_state(carry["rng"])
    key, stopper, order = carry["key"], carry["stopper"], carry["order"]
    losses = np.array(carry["losses"])
    start = int(carry["position"])
    print(f"start {start}", flush=True)
    for position in range(start, STEPS):
        batch = position % BATCHES_PER_EPOCH
        if batch == 0:
            order = rng.permutation(len(DATA_X))
        rows = order[batch * BATCH : (batch + 1) * BATCH]
        x = DATA_X[rows] + 0.01 * rng.normal(size=(BATCH, 4)).astype(np.float32)
        key, dropout_key = jax.random.split(key)
        arrays, loss = run(arrays, x, DATA_Y[rows], dropout_key)
        loss = one_loss(loss)
        stopper = stopper.update(loss)
        losses[position] = np.asarray(loss)
        done = position + 1
        if done % SAVE_EVERY == 0:
            carry = {
                "state": eqx.combine(one_copy(arrays), static),
                "stopper": stopper,
                "key": key,
                "rng": eqx_train.numpy_rng_state(rng),
                "position": np.int64(done),
                "order": order,
                "losses": losses.copy(),
            }
            position_saved[0] = done
            armed[0] = done == kill_at
            manager.save(done, carry)
            print(f"saved {done}", flush=True)
    manager.close()
    checkpoints.save_checkpoint(out, carry, STEPS)


if __name__ == "__main__":
    main()
