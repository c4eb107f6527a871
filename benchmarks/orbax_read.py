"""Orbax checkpoints in: `load_orbax_checkpoint` (tensorstore, no orbax) vs orbax's own
restore of the same checkpoint (target: <= 1.2x orbax's time).

The checkpoint is a model-like tree of `--size-mib` MiB saved by orbax's
`PyTreeCheckpointer` (flax's default layout: OCDBT, zarr v2): a few large float32 leaves,
bfloat16 leaves and `--small-leaves` small ones (biases, norms), as in a real state. Two
reads are compared:

- into NumPy: `load_orbax_checkpoint(path)` vs `PyTreeCheckpointer().restore` with
  `restore_type=np.ndarray` for every array;
- into a target sharded over the 8 simulated devices: `load_orbax_checkpoint(path, target)`
  vs orbax's restore with `ArrayRestoreArgs(sharding=...)` for every array.

Variants run interleaved, each `--repeats` times; the table shows medians.

    python benchmarks/orbax_read.py [--size-mib 256] [--small-leaves 200] [--repeats 5]
                                    [--layout ocdbt|plain]
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

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from _timing import print_table  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from eqx_train.interop import load_orbax_checkpoint  # noqa: E402

BIG_MIB = 16


def make_tree(size_mib: int, small: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    tree: dict[str, np.ndarray] = {}
    for i in range(max(1, size_mib // BIG_MIB)):
        rows = (BIG_MIB << 20) // 4 // 1024
        data = rng.standard_normal((rows, 1024), np.float32)
        tree[f"layer_{i}_kernel"] = data if i % 2 else data.astype(ml_dtypes.bfloat16)
    for i in range(small):
        tree[f"norm_{i}_scale"] = rng.standard_normal(1024, np.float32)
    return tree


def interleaved(variants: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            start = time.perf_counter()
            jax.block_until_ready(run())
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--small-leaves", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--layout", choices=["ocdbt", "plain"], default="ocdbt", help="how orbax saves it"
    )
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="eqx_train_bench_orbax_")
    try:
        tree = make_tree(args.size_mib, args.small_leaves)
        path = os.path.join(root, "checkpoint_1")
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=args.layout == "ocdbt")
        ocp.Checkpointer(handler).save(path, tree)
        mib = sum(a.nbytes for a in tree.values()) / 2**20

        checkpointer = ocp.PyTreeCheckpointer()
        as_numpy = {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in tree}
        mesh = jax.make_mesh((8,), ("x",))
        rows, whole = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
        shardings = {
            k: rows if v.shape[0] % 8 == 0 and v.ndim == 2 else whole for k, v in tree.items()
        }
        target = {
            k: jax.ShapeDtypeStruct(v.shape, jnp.dtype(v.dtype), sharding=shardings[k])
            for k, v in tree.items()
        }
        sharded_args = {k: ocp.ArrayRestoreArgs(sharding=shardings[k]) for k in tree}

        # Same values first: the comparison is of equal work.
        ours, theirs = (
            load_orbax_checkpoint(path),
            checkpointer.restore(path, restore_args=as_numpy),
        )
        assert all(ours[k].tobytes() == theirs[k].tobytes() for k in tree)
        times = interleaved(
            {
                "ours -> NumPy": lambda: load_orbax_checkpoint(path),
                "orbax -> NumPy": lambda: checkpointer.restore(path, restore_args=as_numpy),
                "ours -> sharded": lambda: load_orbax_checkpoint(path, target),
                "orbax -> sharded": lambda: checkpointer.restore(
                    path, item=target, restore_args=sharded_args
                ),
            },
            args.repeats,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows_out = [[n, f"{s * 1e3:.0f}", f"{mib / s:.0f}"] for n, s in times.items()]
    leaves = len(tree)
    print_table(
        f"Orbax checkpoint ({args.layout}), {mib:.0f} MiB in {leaves} leaves, "
        f"medians of {args.repeats}",
        ["variant", "ms", "MiB/s"],
        rows_out,
    )
    numpy_ratio = times["ours -> NumPy"] / times["orbax -> NumPy"]
    sharded_ratio = times["ours -> sharded"] / times["orbax -> sharded"]
    print(
        f"ours / orbax: {numpy_ratio:.2f}x into NumPy, {sharded_ratio:.2f}x into a sharded target"
    )
    summary = {
        "benchmark": "orbax",
        "layout": args.layout,
        "size_mib": round(mib),
        "leaves": leaves,
        "numpy_vs_orbax": round(numpy_ratio, 3),
        "sharded_vs_orbax": round(sharded_ratio, 3),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
