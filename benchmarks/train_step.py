"""Per-step time: flax TrainState + jax.jit vs eqx_train's recommended step (`jit_step`).

Two MLPs (depth 3, batch 128): width 64 is dispatch-bound (Python overhead dominates), width
1024 is compute-bound. All variants run the same arithmetic (Adam on an MSE loss) in one
process; the table reports medians per step and ratios against flax.

    python benchmarks/train_step.py
"""

from __future__ import annotations

import functools
import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
sys.path.insert(0, os.path.dirname(__file__))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from _timing import median_seconds, print_table  # noqa: E402
from flax.training import train_state as flax_train_state  # noqa: E402

import eqx_train  # noqa: E402

STEPS_PER_SAMPLE = 200


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, tree)


def _time_loop(step, carry, *args) -> float:
    box = [carry]

    def run():
        for _ in range(STEPS_PER_SAMPLE):
            box[0] = step(box[0], *args)
        jax.block_until_ready(box[0])

    run()  # compile and warm up
    return median_seconds(run, repeats=5) / STEPS_PER_SAMPLE


def bench(width: int) -> dict[str, float]:
    model = eqx.nn.MLP(32, 10, width, 3, key=jax.random.key(0))
    x, y = jnp.ones((128, 32)), jnp.ones((128, 10))
    tx = optax.adam(1e-3)

    # flax: a params dict and a hand-written apply function, as a flax user would have.
    params = {"layers": [{"w": _copy(lin.weight.T), "b": _copy(lin.bias)} for lin in model.layers]}

    def flax_loss(p):
        h = x
        for i, layer in enumerate(p["layers"]):
            h = h @ layer["w"] + layer["b"]
            if i < len(p["layers"]) - 1:
                h = jax.nn.relu(h)
        return jnp.mean((h - y) ** 2)

    @functools.partial(jax.jit, donate_argnums=0)
    def flax_step(state):
        return state.apply_gradients(grads=jax.grad(flax_loss)(state.params))

    flax_state = flax_train_state.TrainState.create(apply_fn=None, params=params, tx=tx)

    def loss(m, x, y):
        return jnp.mean((jax.vmap(m)(x) - y) ** 2)

    def train_step(state, x, y):
        return state.apply_gradients(grads=eqx.filter_grad(loss)(state.model, x, y))

    naive = eqx.filter_jit(train_step)
    state = eqx_train.TrainState.create(model=_copy(model), tx=tx)
    arrays, static = eqx.partition(
        eqx_train.TrainState.create(model=_copy(model), tx=tx), eqx.is_array
    )
    fast = eqx_train.jit_step(train_step, static)

    return {
        "flax TrainState + jax.jit": _time_loop(flax_step, flax_state),
        "eqx.filter_jit (naive)": _time_loop(naive, state, x, y),
        "eqx_train.jit_step": _time_loop(fast, arrays, x, y),
    }


def main() -> None:
    summary: dict[str, float] = {}
    rows = []
    for width in (64, 1024):
        times = bench(width)
        reference = times["flax TrainState + jax.jit"]
        for name, seconds in times.items():
            rows.append([str(width), name, f"{seconds * 1e6:9.1f}", f"{seconds / reference:5.2f}x"])
        summary[f"jit_step_vs_flax_w{width}"] = round(times["eqx_train.jit_step"] / reference, 3)
        summary[f"filter_jit_vs_flax_w{width}"] = round(
            times["eqx.filter_jit (naive)"] / reference, 3
        )
    print_table(
        f"train step, MLP depth 3, batch 128, {jax.devices()[0].platform}, medians",
        ["width", "variant", "us/step", "vs flax"],
        rows,
    )
    print(json.dumps({"benchmark": "train_step", **summary}))


if __name__ == "__main__":
    main()
