"""Interop speed: the Hugging Face layout vs raw I/O, `eqx-train inspect` start-up, and the
flax msgpack reader vs flax's own restore.

- `save_sharded` / `load_sharded` of a tree of `--size-mib` MiB (float32 leaves of 32 MiB,
  shards of a quarter of the total) vs raw NumPy write+fsync / read of the same bytes into
  the same number of files (target: <= 1.2x).
- `python -m eqx_train inspect` on a checkpoint of that size, wall time of the subprocess
  (target: < 1 s).
- `load_flax_checkpoint` vs `flax.training.checkpoints.restore_checkpoint(path, None)` on a
  `--flax-size-mib` msgpack checkpoint (target: >= 5x faster).

Variants run interleaved, each timed `--repeats` times; the table shows medians.

    python benchmarks/interop.py [--size-mib 1024] [--flax-size-mib 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
from _timing import print_table  # noqa: E402

from eqx_train import checkpoints  # noqa: E402
from eqx_train.interop import load_flax_checkpoint, load_sharded, save_sharded  # noqa: E402

LEAF_MIB = 32


def make_tree(size_mib: int) -> dict[str, np.ndarray]:
    count = max(1, size_mib // LEAF_MIB)
    leaf = min(size_mib, LEAF_MIB) << 18  # float32 elements
    rng = np.random.default_rng(0)
    return {f"layers.{i}.weight": rng.standard_normal(leaf, np.float32) for i in range(count)}


def raw_save(directory: str, tree: dict[str, np.ndarray], shards: int) -> None:
    names = list(tree)
    per = -(-len(names) // shards)
    for k in range(shards):
        path = os.path.join(directory, f"raw-{k}.bin")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for name in names[k * per : (k + 1) * per]:
                view = memoryview(tree[name]).cast("B")
                while view:
                    view = view[os.write(fd, view[: 1 << 30]) :]
            os.fsync(fd)
        finally:
            os.close(fd)


def raw_load(directory: str, shards: int) -> list[np.ndarray]:
    return [np.fromfile(os.path.join(directory, f"raw-{k}.bin"), np.float32) for k in range(shards)]


def interleaved(variants: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def bench_hf(size_mib: int, repeats: int, root: str) -> dict[str, float]:
    tree = make_tree(size_mib)
    shard_bytes = max(1, size_mib // 4) << 20
    shards = -(-size_mib // max(1, size_mib // 4))
    hf_dir, raw_dir = os.path.join(root, "hf"), os.path.join(root, "raw")
    os.makedirs(raw_dir)
    times = interleaved(
        {
            "save_sharded": lambda: save_sharded(hf_dir, tree, max_shard_size=shard_bytes),
            "raw write+fsync": lambda: raw_save(raw_dir, tree, shards),
            "load_sharded": lambda: load_sharded(hf_dir),
            "raw read": lambda: raw_load(raw_dir, shards),
        },
        repeats,
    )
    return times


def bench_inspect(size_mib: int, repeats: int, root: str) -> float:
    path = checkpoints.save_checkpoint(os.path.join(root, "ck"), make_tree(size_mib), 1)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "eqx_train", "inspect", path],
            check=True,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench_flax(size_mib: int, repeats: int, root: str) -> dict[str, float]:
    from flax.training import checkpoints as flax_checkpoints

    flax_checkpoints.config.update("flax_use_orbax_checkpointing", False)
    directory = os.path.join(root, "flax")
    path = flax_checkpoints.save_checkpoint(directory, make_tree(size_mib), 1)
    return interleaved(
        {
            "load_flax_checkpoint": lambda: load_flax_checkpoint(path),
            "flax restore_checkpoint": lambda: flax_checkpoints.restore_checkpoint(path, None),
        },
        repeats,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--flax-size-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="eqx_train_bench_interop_")
    try:
        hf = bench_hf(args.size_mib, args.repeats, root)
        inspect_s = bench_inspect(args.size_mib, args.repeats, root)
        flax = bench_flax(args.flax_size_mib, args.repeats, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mib = args.size_mib
    save_ratio = hf["save_sharded"] / hf["raw write+fsync"]
    load_ratio = hf["load_sharded"] / hf["raw read"]
    rows = [[name, f"{seconds * 1e3:.0f}", f"{mib / seconds:.0f}"] for name, seconds in hf.items()]
    print_table(f"Hugging Face layout, {mib} MiB", ["variant", "ms", "MiB/s"], rows)
    print(f"save_sharded / raw: {save_ratio:.2f}x   load_sharded / raw: {load_ratio:.2f}x")
    print(f"\neqx-train inspect on a {mib} MiB checkpoint (subprocess): {inspect_s:.2f} s")
    summary: dict[str, object] = {
        "size_mib": mib,
        "save_vs_raw": round(save_ratio, 3),
        "load_vs_raw": round(load_ratio, 3),
        "inspect_s": round(inspect_s, 3),
    }
    speedup = flax["flax restore_checkpoint"] / flax["load_flax_checkpoint"]
    rows = [[name, f"{seconds * 1e3:.0f}"] for name, seconds in flax.items()]
    print_table(f"flax msgpack, {args.flax_size_mib} MiB", ["variant", "ms"], rows)
    print(f"load_flax_checkpoint is {speedup:.1f}x faster than flax's restore")
    summary["flax_speedup"] = round(speedup, 2)
    print(json.dumps({"benchmark": "interop", **summary}))


if __name__ == "__main__":
    main()
