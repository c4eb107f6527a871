"""Checkpoints of a state on the default device (a GPU when there is one): what blocks the
training loop, what is lost per save, what host memory it costs.

For a float32 state of `--total-mib` MiB in `--leaves` leaves on the default device, in one
process, variants interleaved (the order rotated every round) and a fresh state for every
measurement (JAX caches an array's host copy after its first transfer, which would make
every later transfer look free):

- async save: how long `save` blocks the caller, and the time until the checkpoint is
  durable; eqx_train (`save_checkpoint` with an `AsyncManager`) and orbax
  `StandardCheckpointer`;
- sync save until durable: eqx_train, and raw `jax.device_get` + write + fsync;
- restore onto the device (a target on the device): eqx_train, orbax, raw read + device_put;
- a loop of compute-bound steps that donate the state, with an async save every 10 steps:
  seconds lost per save against the same loop without saves (eqx_train's
  `CheckpointManager(async_save=True)`, orbax's `CheckpointManager`);
- peak extra host RSS during the async save (until durable) and the restore, and the most
  leaf bytes eqx_train's pipeline held on the host (on a CPU backend RSS also counts the
  device memory, which is host memory there: the pipeline's own count is the clean one).

    python benchmarks/gpu_checkpoints.py [--total-mib 2048] [--leaves 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _timing import PeakRSS, print_table, write_and_fsync  # noqa: E402

from eqx_train import checkpoints  # noqa: E402
from eqx_train.checkpoints import _transfer  # noqa: E402

try:
    import orbax.checkpoint as ocp
except ImportError:  # optional: compared only where it installs
    ocp = None

# ------------------------------------------------------------------------------ the state


def make_state(total_mib: int, leaves: int, seed: int) -> dict[str, jax.Array]:
    """A fresh state on the default device, computed there (no host copy exists yet)."""
    rows = total_mib * 2**20 // 4 // leaves // 1024

    @jax.jit
    def build(seed):
        return {
            f"layer_{i:02d}": (
                jnp.arange(rows * 1024, dtype=jnp.float32) * 1e-6 + seed + i
            ).reshape(rows, 1024)
            for i in range(leaves)
        }

    state = build(jnp.float32(seed))
    jax.block_until_ready(state)
    return state


def fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def fresh_dir(base: str, name: str) -> str:
    path = os.path.join(base, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


# ------------------------------------------------------------------------------ variants


def eqx_async(state, directory) -> tuple[float, float]:
    manager = checkpoints.AsyncManager()
    start = time.perf_counter()
    checkpoints.save_checkpoint(directory, state, 0, async_manager=manager)
    blocked = time.perf_counter() - start
    manager.wait_previous_save()
    return blocked, time.perf_counter() - start


def orbax_async(state, directory) -> tuple[float, float]:
    checkpointer = ocp.StandardCheckpointer()
    start = time.perf_counter()
    checkpointer.save(os.path.join(directory, "orbax"), state)
    blocked = time.perf_counter() - start
    checkpointer.wait_until_finished()
    return blocked, time.perf_counter() - start


def eqx_sync(state, directory) -> float:
    start = time.perf_counter()
    checkpoints.save_checkpoint(directory, state, 0)
    return time.perf_counter() - start


def raw_sync(state, directory) -> float:
    start = time.perf_counter()
    host = jax.device_get(state)
    write_and_fsync(os.path.join(directory, "raw.bin"), host.values())
    return time.perf_counter() - start


def eqx_restore(target, directory) -> Any:
    return checkpoints.restore_checkpoint(directory, target)


def orbax_restore(target, directory) -> Any:
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            target)  # fmt: skip
    return ocp.StandardCheckpointer().restore(os.path.join(directory, "orbax"), abstract)


def raw_restore(target, directory) -> Any:
    out = {}
    with open(os.path.join(directory, "raw.bin"), "rb", buffering=0) as f:
        for name, leaf in target.items():
            host = np.empty(leaf.shape, leaf.dtype)
            f.readinto(host.reshape(-1).view(np.uint8).data)
            out[name] = jax.device_put(host, leaf.sharding)
    return out


# ------------------------------------------------------------------------ the training loop


def make_step(width: int) -> Callable[..., Any]:
    """A compute-bound step that also rewrites the state, donating it (as a training step
    that updates its parameters in place does)."""

    def step(state, x):
        for _ in range(4):
            x = jnp.tanh(x @ x) * 0.5
        scale = 1.0 + 1e-7 * jnp.mean(x)
        return jax.tree.map(lambda leaf: leaf * scale, state), x

    return jax.jit(step, donate_argnums=0)


def run_loop(state, x, step, steps: int, save: Callable[[int, Any], None] | None, wait) -> float:
    start = time.perf_counter()
    for i in range(1, steps + 1):
        state, x = step(state, x)
        if save is not None and i % 10 == 0:
            save(i, state)
    jax.block_until_ready((state, x))
    if wait is not None:
        wait()
    return time.perf_counter() - start


def loop_variants(base: str) -> dict[str, Callable[[Any, Any, Any, int], float]]:
    def plain(state, x, step, steps):
        return run_loop(state, x, step, steps, None, None)

    def eqx(state, x, step, steps):
        directory = fresh_dir(base, "loop_eqx")
        manager = checkpoints.CheckpointManager(directory, keep_latest=1, async_save=True)
        try:
            return run_loop(state, x, step, steps, manager.save, manager.wait)
        finally:
            manager.close()

    variants = {"no saves": plain, "eqx_train": eqx}
    if ocp is not None:

        def orbax(state, x, step, steps):
            directory = fresh_dir(base, "loop_orbax")
            options = ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=True)
            manager = ocp.CheckpointManager(directory, options=options)
            try:
                return run_loop(
                    state,
                    x,
                    step,
                    steps,
                    lambda i, s: manager.save(i, args=ocp.args.StandardSave(s)),
                    manager.wait_until_finished,
                )
            finally:
                manager.close()

        variants["orbax"] = orbax
    return variants


# ------------------------------------------------------------------------------ running


def rotated(names: list[str], round_: int) -> list[str]:
    k = round_ % len(names)
    return names[k:] + names[:k]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total-mib", type=int, default=2048)
    parser.add_argument("--leaves", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=50, help="loop steps (a save every 10)")
    parser.add_argument("--width", type=int, default=0, help="matmul width (0: by platform)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    platform = jax.devices()[0].platform
    width = args.width or (8192 if platform == "gpu" else 384)
    base = tempfile.mkdtemp(prefix="eqx_train_gpu_bench_", dir=args.dir)
    seed = iter(range(1, 1 << 30))
    samples: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        samples.setdefault(key, []).append(value)

    def fresh() -> dict[str, jax.Array]:
        return make_state(args.total_mib, args.leaves, next(seed))

    try:
        # Warm-up: compile the snapshot copy, the steps, orbax's handlers; first-touch pages.
        for name, run in [("eqx", eqx_async), ("orbax", orbax_async)][: 2 if ocp else 1]:
            run(fresh(), fresh_dir(base, f"warm_{name}"))
        saves = {"eqx_train": eqx_async} | ({"orbax": orbax_async} if ocp else {})
        syncs = {"eqx_train": eqx_sync, "raw": raw_sync}
        restores = {"eqx_train": (eqx_sync, eqx_restore), "raw": (raw_sync, raw_restore)}
        if ocp is not None:
            restores["orbax"] = (lambda s, d: orbax_async(s, d)[1], orbax_restore)
        for round_ in range(args.repeats):
            for name in rotated(list(saves), round_):
                directory = fresh_dir(base, f"async_{name}")
                state = fresh()
                _transfer.reset_peak()
                held_before = _transfer.held_bytes()
                with PeakRSS() as peak:
                    blocked, durable = saves[name](state, directory)
                add(f"{name}.async_block_s", blocked)
                add(f"{name}.async_durable_s", durable)
                add(f"{name}.async_peak_rss_mib", peak.extra_mib)
                if name == "eqx_train":
                    add(
                        "eqx_train.async_pipeline_peak_mib",
                        (_transfer.peak_held_bytes() - held_before) / 2**20,
                    )
                del state
            for name in rotated(list(syncs), round_):
                directory = fresh_dir(base, f"sync_{name}")
                add(f"{name}.sync_s", syncs[name](fresh(), directory))
            for name in rotated(list(restores), round_):
                save, restore = restores[name]
                directory = fresh_dir(base, f"restore_{name}")
                state = fresh()
                save(state, directory)
                target = fresh()  # the target on the device, as a resumed run has it
                del state
                _transfer.reset_peak()
                held_before = _transfer.held_bytes()
                with PeakRSS() as peak:
                    start = time.perf_counter()
                    restored = restore(target, directory)
                    jax.block_until_ready(restored)
                    add(f"{name}.restore_s", time.perf_counter() - start)
                add(f"{name}.restore_peak_rss_mib", peak.extra_mib)
                if name == "eqx_train":
                    add(
                        "eqx_train.restore_pipeline_peak_mib",
                        (_transfer.peak_held_bytes() - held_before) / 2**20,
                    )
                del restored, target
            step = make_step(width)
            loops = loop_variants(base)
            x0 = jnp.eye(width, dtype=jnp.float32)
            if round_ == 0:  # compile the step outside the timings
                run_loop(fresh(), x0, step, 2, None, None)
            for name in rotated(list(loops), round_):
                add(f"{name}.loop_s", loops[name](fresh(), x0, step, args.steps))
    finally:
        shutil.rmtree(base, ignore_errors=True)

    med = {key: statistics.median(values) for key, values in samples.items()}
    n_saves = args.steps // 10
    for name in ("eqx_train", "orbax"):
        if f"{name}.loop_s" in med:
            med[f"{name}.lost_per_save_s"] = (med[f"{name}.loop_s"] - med["no saves.loop_s"]) / (
                n_saves
            )

    def cell(key: str, unit: str) -> str:
        if key not in med:
            return "-"
        return f"{med[key]:.3f} s" if unit == "s" else f"{med[key]:.0f} MiB"

    methods = ["eqx_train", "orbax", "raw"]
    timed = [
        ("async save: blocks the caller", "async_block_s", "s"),
        ("async save: until durable", "async_durable_s", "s"),
        ("sync save (until durable)", "sync_s", "s"),
        ("restore onto the device", "restore_s", "s"),
        ("loop, save every 10 steps: lost per save", "lost_per_save_s", "s"),
        ("async save: peak extra host RSS", "async_peak_rss_mib", "MiB"),
        ("restore: peak extra host RSS", "restore_peak_rss_mib", "MiB"),
        ("async save: pipeline's host bytes (peak)", "async_pipeline_peak_mib", "MiB"),
        ("restore: pipeline's host bytes (peak)", "restore_pipeline_peak_mib", "MiB"),
    ]
    rows = [[label, *(cell(f"{m}.{key}", unit) for m in methods)] for label, key, unit in timed]
    print_table(
        f"{args.total_mib} MiB float32 state in {args.leaves} leaves on {jax.devices()[0]} "
        f"(JAX {jax.__version__}), median of {args.repeats}; loop: {args.steps} steps, "
        f"width {width}, no-save loop {med['no saves.loop_s']:.2f} s",
        ["", "eqx_train", "orbax Standard/CheckpointManager", "raw device_get+write+fsync"],
        rows,
    )
    summary = {key.replace(" ", "_"): round(value, 4) for key, value in sorted(med.items())}
    if "orbax.async_block_s" in med:
        summary["async_block_vs_orbax"] = round(
            med["eqx_train.async_block_s"] / med["orbax.async_block_s"], 3
        )
        summary["restore_vs_orbax"] = round(med["eqx_train.restore_s"] / med["orbax.restore_s"], 3)
        summary["sync_save_vs_orbax_durable"] = round(
            med["eqx_train.sync_s"] / med["orbax.async_durable_s"], 3
        )
    summary["sync_save_vs_raw"] = round(med["eqx_train.sync_s"] / med["raw.sync_s"], 3)
    print(
        json.dumps(
            {
                "benchmark": "gpu_checkpoints",
                "platform": platform,
                "total_mib": args.total_mib,
                "leaves": args.leaves,
                **summary,
            }
        )
    )


if __name__ == "__main__":
    main()
