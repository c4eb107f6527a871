"""Warm restores of one checkpoint by two checkouts of eqx_train, interleaved: medians and
their ratio, measured in the same run.

A float32 state of random values (`--mib` MiB in `--leaves` leaves) is saved once by the
first checkout; then, for `--rounds` rounds, each checkout (the order swapped every round)
restores it in a fresh process `--repeats` times into a target on the default device, and
the first restore of each process (imports, the page cache, the compiler) is dropped:

    python benchmarks/restore_versions.py --trees ../before . --mib 512 --leaves 32

A restore's time varies from run to run on a loaded machine (by up to 3x on a 2-core one),
so compare only the medians of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def child(directory: str, mib: int, leaves: int, repeats: int) -> None:
    import jax
    import jax.numpy as jnp

    from eqx_train import checkpoints

    n = (mib << 20) // 4 // leaves
    target = {f"w{i:03d}": jnp.zeros(n, jnp.float32) for i in range(leaves)}
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(checkpoints.restore_checkpoint(directory, target))
        times.append(time.perf_counter() - start)
    print(json.dumps(times))


def save(directory: str, mib: int, leaves: int) -> None:
    import jax

    from eqx_train import checkpoints

    n = (mib << 20) // 4 // leaves
    state = {f"w{i:03d}": jax.random.normal(jax.random.key(i), (n,)) for i in range(leaves)}
    checkpoints.save_checkpoint(directory, state, 0)


def run(tree: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    done = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, env=env
    )
    if done.returncode:
        raise SystemExit(f"{tree}: {done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trees", nargs=2, required=True, help="two checkouts: before, after")
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--leaves", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="restores per process")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--save", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        directory, mib, leaves, repeats = args.child
        return child(directory, int(mib), int(leaves), int(repeats))
    if args.save:
        directory, mib, leaves = args.save
        return save(directory, int(mib), int(leaves))
    before, after = args.trees
    with tempfile.TemporaryDirectory() as directory:
        run(before, "--trees", before, after, "--save", directory, str(args.mib), str(args.leaves))
        times: dict[str, list[float]] = {before: [], after: []}
        for round_ in range(args.rounds):
            for tree in (before, after) if round_ % 2 == 0 else (after, before):
                shape = [directory, str(args.mib), str(args.leaves), str(args.repeats)]
                out = run(tree, "--trees", before, after, "--child", *shape)
                times[tree] += json.loads(out)[1:]
    medians = {tree: statistics.median(values) for tree, values in times.items()}
    print(
        json.dumps(
            {
                "mib": args.mib,
                "leaves": args.leaves,
                "samples": len(times[before]),
                "median_s": {tree: round(m, 4) for tree, m in medians.items()},
                "after_over_before": round(medians[after] / medians[before], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
