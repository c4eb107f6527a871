"""Checkpoint save/restore speed and memory: eqx_train vs raw I/O, safetensors, flax, equinox.

For a 256 MiB and a 1 GiB tree (16 and 32 float32 leaves of JAX arrays, pre-touched), in one
process: raw NumPy write+fsync / parallel read and placement of the same bytes (the physical
reference), `safetensors.numpy` save/load, flax's msgpack checkpoints,
`eqx.tree_serialise_leaves`, and eqx_train. Each save ends with the data durable (fsync)
where the library does so; restores read a file just written (page cache). Peak extra memory
while saving is sampled from RSS. Also measures restoring one leaf of the 1 GiB checkpoint.

    python benchmarks/checkpoints.py [--sizes 256 1024] [--repeats 3] [--methods raw eqx_train]

Prints, per size, a breakdown of one eqx_train save and restore by stage (seconds busy
waiting for transfers, hashing, writing, fsync, reading, verifying, placing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
sys.path.insert(0, os.path.dirname(__file__))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from _timing import PeakRSS, print_table, write_and_fsync  # noqa: E402

from eqx_train import checkpoints  # noqa: E402
from eqx_train.checkpoints.format._reader import aligned_empty  # noqa: E402
from eqx_train.checkpoints.pipeline import _window  # noqa: E402


def make_tree(total_mib: int, leaves: int) -> dict[str, jax.Array]:
    per_leaf = total_mib * 2**20 // 4 // leaves
    tree = {}
    for i in range(leaves):
        host = np.random.default_rng(i).standard_normal(per_leaf, dtype=np.float32)
        tree[f"layer_{i:02d}"] = jax.device_put(host.reshape(-1, 1024))
    jax.block_until_ready(tree)
    return tree


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)


def raw_save(tree, directory):
    write_and_fsync(os.path.join(directory, "raw.bin"), (np.asarray(x) for x in tree.values()))


def raw_restore(tree, directory):
    """The bytes of every leaf read into new 64-byte-aligned arrays by 8 threads (`pread`)
    and placed on the device: what any restore must do, without a format or checks. (One
    thread reading into fresh arrays is no reference on this machine: its first touch of
    new memory costs 2-15x the read, and varies that much from run to run.)"""
    fd = os.open(os.path.join(directory, "raw.bin"), os.O_RDONLY)
    jobs, offset = [], 0
    for name, leaf in tree.items():
        jobs.append((name, offset, leaf.shape))
        offset += leaf.size * 4

    def read(job):
        name, offset, shape = job
        array = aligned_empty(shape, np.dtype(np.float32))
        view, done = array.reshape(-1).view(np.uint8), 0
        while done < view.nbytes:  # a read may return fewer bytes than asked
            done += os.preadv(fd, [view[done:]], offset + done)
        return name, jax.device_put(array)

    try:
        with ThreadPoolExecutor(8) as pool:
            return dict(pool.map(read, jobs))
    finally:
        os.close(fd)


def safetensors_save(tree, directory):
    from safetensors.numpy import save_file

    path = os.path.join(directory, "st.safetensors")
    save_file({k: np.asarray(v) for k, v in tree.items()}, path)
    fsync_file(path)


def safetensors_restore(tree, directory):
    from safetensors.numpy import load_file

    return load_file(os.path.join(directory, "st.safetensors"))


def flax_save(tree, directory):
    from flax import config as flax_config
    from flax.training import checkpoints as flax_checkpoints

    flax_config.update("flax_use_orbax_checkpointing", False)
    flax_checkpoints.save_checkpoint(directory, tree, 0, overwrite=True)
    fsync_file(os.path.join(directory, "checkpoint_0"))


def flax_restore(tree, directory):
    from flax.training import checkpoints as flax_checkpoints

    return flax_checkpoints.restore_checkpoint(directory, tree)


def equinox_save(tree, directory):
    path = os.path.join(directory, "eqx.eqx")
    eqx.tree_serialise_leaves(path, tree)
    fsync_file(path)


def equinox_restore(tree, directory):
    return eqx.tree_deserialise_leaves(os.path.join(directory, "eqx.eqx"), tree)


def orbax_save(tree, directory):
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(os.path.abspath(directory), "orbax"), tree)
    checkpointer.wait_until_finished()


def orbax_restore(tree, directory):
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer().restore(
        os.path.join(os.path.abspath(directory), "orbax"), tree
    )


def ours_save(tree, directory):
    checkpoints.save_checkpoint(directory, tree, 0, overwrite=True)


def ours_restore(tree, directory):
    return checkpoints.restore_checkpoint(directory, tree)


def ours_restore_unverified(tree, directory):
    return checkpoints.restore_checkpoint(directory, tree, verify=False)


METHODS = {
    "raw write+fsync / read": (raw_save, raw_restore),
    "safetensors.numpy": (safetensors_save, safetensors_restore),
    "flax msgpack": (flax_save, flax_restore),
    "equinox tree_serialise_leaves": (equinox_save, equinox_restore),
    "eqx_train": (ours_save, ours_restore),
    "eqx_train, verify=False": (ours_save, ours_restore_unverified),
}
try:
    import orbax.checkpoint  # noqa: F401

    METHODS["orbax StandardCheckpointer"] = (orbax_save, orbax_restore)
except ImportError:  # optional: compared only where it installs
    pass


def measure(tree, base_dir: str, repeats: int, names: list[str]) -> dict[str, dict[str, float]]:
    """Runs every method once per repeat, rotating the order so that no method always meets
    a cold allocator (first-touch page faults dominate fresh allocations on this machine)."""
    samples: dict[str, dict[str, list[float]]] = {
        n: {"save_s": [], "restore_s": [], "save_extra_mib": []} for n in names
    }
    for repeat in range(repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        for name in order:
            save, restore = METHODS[name]
            directory = os.path.join(base_dir, name.split()[0])
            drop_dir(directory)
            os.sync()  # start from a clean disk: no earlier writeback lands in this fsync
            with PeakRSS() as peak:
                start = time.perf_counter()
                save(tree, directory)
                samples[name]["save_s"].append(time.perf_counter() - start)
            samples[name]["save_extra_mib"].append(peak.extra_mib)
            os.sync()
            start = time.perf_counter()
            restored = restore(tree, directory)
            jax.block_until_ready(restored)
            samples[name]["restore_s"].append(time.perf_counter() - start)
            del restored
            drop_dir(directory)
    return {
        name: {key: float(np.median(values)) for key, values in by_key.items()}
        for name, by_key in samples.items()
    }


def one_leaf_restore(tree, base_dir: str) -> tuple[float, float]:
    directory = os.path.join(base_dir, "one_leaf")
    drop_dir(directory)
    checkpoints.save_checkpoint(directory, tree, 0)
    name = next(iter(tree))
    target = {name: jax.ShapeDtypeStruct(tree[name].shape, tree[name].dtype)}
    start = time.perf_counter()
    with warnings.catch_warnings():  # the other leaves unused: intended here
        warnings.simplefilter("ignore", checkpoints.PartialRestoreWarning)
        jax.block_until_ready(checkpoints.restore_checkpoint(directory, target, strict=False))
    one = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(checkpoints.restore_checkpoint(directory, tree))
    return one, time.perf_counter() - start


def stage_breakdown(tree, base_dir: str) -> dict[str, dict[str, float]]:
    """Seconds each stage of one eqx_train save and one restore was busy (stages that
    overlap add up to more than the wall time)."""
    directory = os.path.join(base_dir, "stages")
    drop_dir(directory)
    result = {}
    for what, run in [
        ("save", lambda: ours_save(tree, directory)),
        ("restore", lambda: jax.block_until_ready(ours_restore(tree, directory))),
    ]:
        with _window.stage_times() as times:
            start = time.perf_counter()
            run()
            times["wall"] = time.perf_counter() - start
        result[what] = dict(times)
    drop_dir(directory)
    return result


STAGES = ["wall", "transfer", "hash", "write", "fsync", "read", "verify", "place"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024], help="MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument(
        "--methods", nargs="+", default=None, help="first words of the methods (default: all)"
    )
    args = parser.parse_args()
    names = [n for n in METHODS if args.methods is None or n.split()[0].rstrip(",") in args.methods]
    names = list(dict.fromkeys(["raw write+fsync / read", *names]))  # the reference, always
    summary: dict[str, float] = {}
    base_dir = tempfile.mkdtemp(prefix="eqx_train_bench_", dir=args.dir)
    try:
        for size in args.sizes:
            leaves = 16 if size <= 256 else 32
            tree = make_tree(size, leaves)
            results = measure(tree, base_dir, args.repeats, names)
            raw = results["raw write+fsync / read"]
            rows = []
            for name, r in results.items():
                rows.append(
                    [
                        name,
                        f"{r['save_s'] * 1e3:8.0f}",
                        f"{r['save_s'] / raw['save_s']:5.2f}x",
                        f"{r['restore_s'] * 1e3:8.0f}",
                        f"{r['restore_s'] / raw['restore_s']:5.2f}x",
                        f"{r['save_extra_mib']:7.0f}",
                    ]
                )
            print_table(
                f"{size} MiB tree, {leaves} float32 leaves, {jax.devices()[0].platform}, "
                f"median of {args.repeats}",
                ["method", "save ms", "vs raw", "restore ms", "vs raw", "save extra MiB"],
                rows,
            )
            stages = stage_breakdown(tree, base_dir)
            print_table(
                "eqx_train stage breakdown, seconds busy (overlapping stages add up to more)",
                ["", *STAGES],
                [[w, *(f"{t.get(s, 0.0):.3f}" for s in STAGES)] for w, t in stages.items()],
            )
            summary[f"stages_{size}MiB"] = {
                w: {s: round(v, 4) for s, v in t.items()} for w, t in stages.items()
            }
            ours = results["eqx_train"]
            summary[f"save_vs_raw_{size}MiB"] = round(ours["save_s"] / raw["save_s"], 3)
            summary[f"restore_vs_raw_{size}MiB"] = round(ours["restore_s"] / raw["restore_s"], 3)
            if "flax msgpack" in results:
                flax = results["flax msgpack"]
                summary[f"flax_save_vs_ours_{size}MiB"] = round(flax["save_s"] / ours["save_s"], 2)
                summary[f"flax_restore_vs_ours_{size}MiB"] = round(
                    flax["restore_s"] / ours["restore_s"], 2
                )
                summary[f"flax_save_extra_mib_{size}MiB"] = round(flax["save_extra_mib"], 1)
            if "orbax StandardCheckpointer" in results:
                orbax = results["orbax StandardCheckpointer"]
                summary[f"orbax_save_vs_ours_{size}MiB"] = round(
                    orbax["save_s"] / ours["save_s"], 2
                )
                summary[f"orbax_restore_vs_ours_{size}MiB"] = round(
                    orbax["restore_s"] / ours["restore_s"], 2
                )
            if "eqx_train, verify=False" in results:
                unverified = results["eqx_train, verify=False"]
                summary[f"restore_unverified_vs_raw_{size}MiB"] = round(
                    unverified["restore_s"] / raw["restore_s"], 3
                )
            summary[f"save_extra_mib_{size}MiB"] = round(ours["save_extra_mib"], 1)
            if size == max(args.sizes):
                one, full = one_leaf_restore(tree, base_dir)
                print(
                    f"\nrestore 1 of {leaves} leaves: {one * 1e3:.0f} ms; all: {full * 1e3:.0f} ms"
                )
                summary[f"one_leaf_vs_full_{size}MiB"] = round(one / full, 3)
            del tree
    finally:
        shutil.rmtree(base_dir, ignore_errors=True)
    print(json.dumps({"benchmark": "checkpoints", **summary}))


if __name__ == "__main__":
    main()
