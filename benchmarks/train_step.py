"""Per-step time of training steps: one device, and data-parallel over 8 devices.

Two MLPs (depth 3, Adam on an MSE loss): width 64 is dispatch-bound (Python overhead
dominates), width 1024 is compute-bound. Every variant of a table runs the same arithmetic in
one process, and the variants are interleaved (one sample of each in turn, repeated), so
that a slow patch of a shared machine hits them all alike; the table reports medians per
step and ratios measured in the same run.

- one device, batch 128: flax `TrainState` + `jax.jit`, `eqx.filter_jit`, `eqx_train.jit_step`;
- 8 devices, global batch 1024 (128 per device): flax's pmap step (flax `TrainState`,
  `flax.jax_utils.replicate`, `lax.pmean`), eqx_train's pmap track (`replicate`, `pmean`,
  `eqx_train.pmap_step`), `eqx.filter_pmap` on the whole replicated `TrainState`, and
  eqx_train's mesh track (`jax.jit` via `jit_step`, the state replicated with
  `NamedSharding(mesh, P())`, the batch placed with `shard_to_mesh`).

    python benchmarks/train_step.py
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(__file__))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _timing import print_table  # noqa: E402
from flax import jax_utils as flax_jax_utils  # noqa: E402
from flax.training import (
    common_utils as flax_common_utils,  # noqa: E402
    train_state as flax_train_state,  # noqa: E402
)
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import eqx_train  # noqa: E402

STEPS_PER_SAMPLE = {64: 100, 1024: 10}  # per width: about 0.1 s to 1 s per sample here
SAMPLES = 11
# Multi-device loops wait for the devices every this many steps, as a loop that logs its
# loss does. With 100 collective steps queued at once, JAX 0.10.2's CPU runtime aborted in
# an all-reduce rendezvous on the 2-core development machine, for flax's pmap step as well
# as ours. One-device loops (no collectives) never wait, so their dispatch cost shows fully.
IN_FLIGHT = 8
PER_DEVICE_BATCH = 128


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, tree)


class _Loop:
    """A step function and its carry: `sample()` runs `steps` steps and returns s/step,
    waiting for the devices every `in_flight` steps (never when `None`)."""

    def __init__(
        self, steps: int, step: Callable[..., Any], carry: Any, *args: Any, in_flight=None
    ):
        self.steps, self.step, self.carry, self.args = steps, step, carry, args
        self.in_flight = in_flight

    def sample(self) -> float:
        start = time.perf_counter()
        for i in range(self.steps):
            self.carry = self.step(self.carry, *self.args)
            if self.in_flight and i % self.in_flight == self.in_flight - 1:
                jax.block_until_ready(self.carry)
        jax.block_until_ready(self.carry)
        return (time.perf_counter() - start) / self.steps


def interleaved_medians(loops: dict[str, _Loop]) -> dict[str, float]:
    """Warms every loop up, then takes `SAMPLES` rounds of one sample per loop, rotating the
    order each round; returns each loop's median seconds per step."""
    for loop in loops.values():
        loop.sample()  # compile and warm up
    names = list(loops)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(SAMPLES):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            samples[name].append(loops[name].sample())
    return {name: statistics.median(times) for name, times in samples.items()}


def _params_dict(model: eqx.nn.MLP) -> dict:
    """The MLP's weights as a flax user would hold them: a params dict of `w`, `b`."""
    return {"layers": [{"w": _copy(lin.weight.T), "b": _copy(lin.bias)} for lin in model.layers]}


def _flax_loss(params, x, y):
    h = x
    for i, layer in enumerate(params["layers"]):
        h = h @ layer["w"] + layer["b"]
        if i < len(params["layers"]) - 1:
            h = jax.nn.relu(h)
    return jnp.mean((h - y) ** 2)


def _loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _train_step(state, x, y):
    return state.apply_gradients(grads=eqx.filter_grad(_loss)(state.model, x, y))


def one_device(width: int) -> dict[str, float]:
    model = eqx.nn.MLP(32, 10, width, 3, key=jax.random.key(0))
    x, y = jnp.ones((PER_DEVICE_BATCH, 32)), jnp.ones((PER_DEVICE_BATCH, 10))
    tx = optax.adam(1e-3)

    @functools.partial(jax.jit, donate_argnums=0)
    def flax_step(state, x, y):  # the batch as arguments, as for every other variant
        return state.apply_gradients(grads=jax.grad(_flax_loss)(state.params, x, y))

    flax_state = flax_train_state.TrainState.create(
        apply_fn=None, params=_params_dict(model), tx=tx
    )
    state = eqx_train.TrainState.create(model=_copy(model), tx=tx)
    arrays, static = eqx.partition(
        eqx_train.TrainState.create(model=_copy(model), tx=tx), eqx.is_array
    )
    steps = STEPS_PER_SAMPLE[width]
    return interleaved_medians(
        {
            "flax TrainState + jax.jit": _Loop(steps, flax_step, flax_state, x, y),
            "eqx.filter_jit (naive)": _Loop(steps, eqx.filter_jit(_train_step), state, x, y),
            "eqx_train.jit_step": _Loop(
                steps, eqx_train.jit_step(_train_step, static), arrays, x, y
            ),
        }
    )


def eight_devices(width: int) -> dict[str, float]:
    devices = jax.local_devices()
    n = len(devices)
    model = eqx.nn.MLP(32, 10, width, 3, key=jax.random.key(0))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n * PER_DEVICE_BATCH, 32)).astype(np.float32)
    y = rng.standard_normal((n * PER_DEVICE_BATCH, 10)).astype(np.float32)
    tx = optax.adam(1e-3)

    # flax's pmap recipe, as in flax's examples.
    def flax_step(state, x, y):
        grads = jax.lax.pmean(jax.grad(_flax_loss)(state.params, x, y), "batch")
        return state.apply_gradients(grads=grads)

    flax_state = flax_jax_utils.replicate(
        flax_train_state.TrainState.create(apply_fn=None, params=_params_dict(model), tx=tx)
    )
    device_axis = NamedSharding(Mesh(np.array(devices), ("d",)), PartitionSpec("d"))
    flax_batch = jax.device_put(flax_common_utils.shard((x, y)), device_axis)

    # eqx_train's pmap track.
    arrays, static = eqx.partition(
        eqx_train.TrainState.create(model=_copy(model), tx=tx), eqx.is_array
    )

    def pmap_train_step(state, x, y):
        grads = eqx_train.pmean(eqx.filter_grad(_loss)(state.model, x, y), "batch")
        return state.apply_gradients(grads=grads)

    pmap_batch = jax.device_put(eqx_train.shard((x, y)), device_axis)

    # eqx_train's mesh track: one jit over the mesh; XLA inserts the gradient all-reduce.
    mesh = Mesh(np.array(devices), ("batch",))
    mesh_arrays = jax.device_put(
        eqx.partition(eqx_train.TrainState.create(model=_copy(model), tx=tx), eqx.is_array)[0],
        NamedSharding(mesh, PartitionSpec()),
    )
    mesh_batch = eqx_train.shard_to_mesh((x, y), mesh)

    steps = STEPS_PER_SAMPLE[width]
    return interleaved_medians(
        {
            "flax pmap step": _Loop(
                steps,
                jax.pmap(flax_step, axis_name="batch", donate_argnums=0),
                flax_state,
                *flax_batch,
                in_flight=IN_FLIGHT,
            ),
            "eqx_train.pmap_step": _Loop(
                steps,
                eqx_train.pmap_step(pmap_train_step, static),
                eqx_train.replicate(arrays),
                *pmap_batch,
                in_flight=IN_FLIGHT,
            ),
            "eqx.filter_pmap (whole state)": _Loop(
                steps,
                eqx.filter_pmap(pmap_train_step, axis_name="batch", donate="all"),
                eqx_train.replicate(eqx_train.TrainState.create(model=_copy(model), tx=tx)),
                *pmap_batch,
                in_flight=IN_FLIGHT,
            ),
            "eqx_train mesh track (jit)": _Loop(
                steps,
                eqx_train.jit_step(_train_step, static),
                mesh_arrays,
                *mesh_batch,
                in_flight=IN_FLIGHT,
            ),
        }
    )


def main() -> None:
    summary: dict[str, float] = {}
    single_rows, parallel_rows = [], []
    for width in (64, 1024):
        times = one_device(width)
        reference = times["flax TrainState + jax.jit"]
        for name, seconds in times.items():
            single_rows.append(
                [str(width), name, f"{seconds * 1e6:9.1f}", f"{seconds / reference:5.2f}x"]
            )
        summary[f"jit_step_vs_flax_w{width}"] = round(times["eqx_train.jit_step"] / reference, 3)
        summary[f"filter_jit_vs_flax_w{width}"] = round(
            times["eqx.filter_jit (naive)"] / reference, 3
        )

        times = eight_devices(width)
        flax_pmap, pmap = times["flax pmap step"], times["eqx_train.pmap_step"]
        for name, seconds in times.items():
            parallel_rows.append(
                [
                    str(width),
                    name,
                    f"{seconds * 1e6:9.1f}",
                    f"{seconds / flax_pmap:5.2f}x",
                    f"{seconds / pmap:5.2f}x",
                ]
            )
        summary[f"mesh_vs_pmap_w{width}"] = round(times["eqx_train mesh track (jit)"] / pmap, 3)
        summary[f"mesh_vs_flax_pmap_w{width}"] = round(
            times["eqx_train mesh track (jit)"] / flax_pmap, 3
        )
        summary[f"pmap_step_vs_flax_pmap_w{width}"] = round(pmap / flax_pmap, 3)
        summary[f"filter_pmap_vs_flax_pmap_w{width}"] = round(
            times["eqx.filter_pmap (whole state)"] / flax_pmap, 3
        )
    platform = jax.devices()[0].platform
    print_table(
        f"train step, one device, MLP depth 3, batch {PER_DEVICE_BATCH}, {platform}, medians",
        ["width", "variant", "us/step", "vs flax"],
        single_rows,
    )
    print_table(
        f"data-parallel train step, {jax.device_count()} {platform} devices, MLP depth 3, "
        f"global batch {jax.device_count() * PER_DEVICE_BATCH}, medians",
        ["width", "variant", "us/step", "vs flax pmap", "vs pmap_step"],
        parallel_rows,
    )
    print(json.dumps({"benchmark": "train_step", "jax": jax.__version__, **summary}))


if __name__ == "__main__":
    main()
