"""Aggregate multi-process save throughput vs one process, on loopback; and replicated
state saved replica-parallel and restored read-once, through per-process bandwidth caps.

    python benchmarks/multiprocess_checkpoints.py [--mib 512] [--repeats 5]
    python benchmarks/multiprocess_checkpoints.py --replicated [--mib 32] [--counts 1 2 4 8]
        [--rate-mib 8] [--repeats 2]

Saves one float32 array of `--mib` MiB sharded over 4 CPU devices: once from a single process
holding all 4 devices, and once from 2 `jax.distributed` processes with 2 devices each (each
writes half). Reports medians and the ratio of the 2-process aggregate throughput to twice
the single-process throughput (1.0 would be perfect scaling).

With `--replicated`: N = `--counts` real `jax.distributed` processes on loopback (one CPU
device each, gloo collectives) hold one fully replicated float32 state of `--mib` MiB and
save it to, then restore it from, a SeaweedFS bucket on 127.0.0.1. Each process talks to
the bucket through its own proxy (`tests.support.fault_proxy.FaultProxy`) capped at `--rate-mib`
MiB/s each way, as a host's own network link would be, so the links are the bound as at
scale. Every N runs twice, one job after the other: `replica_parallel=False` (process 0
writes everything, every process reads everything) and the default. Reported per process:
bytes sent and fetched (the proxy's exact counters, per save + restore, averaged over every
run with the warm-up), and the median save
and restore times; then each time's ratio to `replica_parallel=False` in the same run.
Targets (issue 26): each process writes <= 1.1 x state / N and reads <= 1.1 x its share +
headers; save and restore >= 0.7 x N times faster at N = 4 and 8.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(
    pid: int, count: int, port: str, mib: int, repeats: int, directory: str, method: str
) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={4 // count}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if count > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=count, process_id=pid)
        from jax.experimental import multihost_utils

        def barrier():
            multihost_utils.broadcast_one_to_all(np.zeros(1, np.uint32))
    else:

        def barrier():
            pass

    from eqx_train import checkpoints

    rows = mib * 2**20 // 4 // 1024
    mesh = Mesh(np.array(jax.devices()), ("d",))
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    array = jax.make_array_from_callback(
        (rows, 1024),
        sharding,
        lambda idx: np.random.default_rng(idx[0].start or 0).standard_normal(
            (idx[0].stop - (idx[0].start or 0), 1024), dtype=np.float32
        ),
    )
    jax.block_until_ready(array)
    if method == "orbax":
        import orbax.checkpoint as ocp

        checkpointer = ocp.StandardCheckpointer()

        def save(step):
            checkpointer.save(os.path.join(directory, f"orbax_{step}"), {"w": array})
            checkpointer.wait_until_finished()
    else:

        def save(step):
            checkpoints.save_checkpoint_multiprocess(directory, {"w": array}, step, keep=1)

    times = []
    for step in range(repeats + 1):
        barrier()
        os.sync()
        barrier()
        start = time.perf_counter()
        save(step)
        barrier()
        times.append(time.perf_counter() - start)
    if pid == 0:
        print(json.dumps({"seconds": statistics.median(times[1:])}), flush=True)
    if count > 1:
        jax.distributed.shutdown()


def replicated_worker(
    pid: int, count: int, port: str, mib: int, repeats: int, url: str, replica_parallel: bool
) -> None:
    """One process of a `--replicated` job: times each save and restore, barrier to barrier."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, KeyError, ValueError):  # a JAX where gloo is the only choice
        pass
    if count > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=count, process_id=pid)
    from eqx_train import checkpoints
    from eqx_train.checkpoints.pipeline import _coordination

    def barrier():
        if count > 1:
            _coordination.barrier(_coordination.next_id("bench"), timeout_s=600)

    replicated = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), PartitionSpec())
    value = np.random.default_rng(0).standard_normal((mib * 256, 1024), dtype=np.float32)
    state = {"w": jax.make_array_from_callback(value.shape, replicated, lambda i: value[i])}
    target = {"w": jax.ShapeDtypeStruct(value.shape, np.float32, sharding=replicated)}
    options = {"replica_parallel": replica_parallel}
    saves, restores = [], []
    for step in range(repeats + 1):  # the first is a warm-up (clients, compilations)
        barrier()
        start = time.perf_counter()
        checkpoints.save_checkpoint_multiprocess(url, state, step, keep=1, **options)
        barrier()
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        restored = checkpoints.restore_checkpoint(url, target, **options)
        jax.block_until_ready(restored)
        barrier()
        restores.append(time.perf_counter() - start)
        for shard in restored["w"].addressable_shards:  # bit-exact, every time
            assert np.array_equal(np.asarray(shard.data), value[shard.index])
        del restored
    summary = {"save_s": statistics.median(saves[1:]), "restore_s": statistics.median(restores[1:])}
    print(json.dumps(summary), flush=True)
    if count > 1:
        jax.distributed.shutdown()


def run_replicated(
    server: Any, count: int, mib: int, repeats: int, rate: float, replica_parallel: bool
) -> list[dict[str, float]]:
    """One job: per process, its times and its proxy's byte counts per save + restore."""
    from tests.support.fault_proxy import FaultProxy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    url = f"{server.create_bucket(f'rp-{count}-{int(replica_parallel)}-{port}')}/run"
    proxies = [FaultProxy(server.endpoint_url, rate_bytes_per_s=rate) for _ in range(count)]
    try:
        processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--replicated-worker",
                    str(i),
                    str(count),
                    port,
                    str(mib),
                    str(repeats),
                    url,
                    str(int(replica_parallel)),
                ],
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, **server.env, "AWS_ENDPOINT_URL": proxy.url, "PYTHONPATH": ROOT},
            )
            for i, proxy in enumerate(proxies)
        ]
        outputs = [p.communicate(timeout=1800)[0] for p in processes]
        if any(p.returncode for p in processes):
            raise RuntimeError(f"a process of the {count}-process job failed:\n{outputs}")
        results = []
        for output, proxy in zip(outputs, proxies, strict=True):
            line = [ln for ln in output.splitlines() if ln.startswith("{")][-1]
            results.append(
                {**json.loads(line), "sent": proxy.bytes_up / (repeats + 1),
                 "fetched": proxy.bytes_down / (repeats + 1)}
            )  # fmt: skip
        return results
    finally:
        for proxy in proxies:
            proxy.close()


def replicated_main(args: argparse.Namespace) -> None:
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.dirname(__file__))
    from _timing import print_table

    from tests.support.s3_server import SeaweedS3

    rate, state = args.rate_mib * 2**20, args.mib * 2**20
    rows, summary = [], {"benchmark": "multiprocess_checkpoints_replicated", "mib": args.mib,
                         "rate_mib_s": args.rate_mib, "counts": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as data:
        server = SeaweedS3(data).start()
        try:
            for count in args.counts:
                runs = {rp: run_replicated(server, count, args.mib, args.repeats, rate, rp)
                        for rp in (False, True)}  # fmt: skip
                ratios = {
                    what: max(r[what] for r in runs[False]) / max(r[what] for r in runs[True])
                    for what in ("save_s", "restore_s")
                }
                summary["counts"][count] = {k: round(v, 2) for k, v in ratios.items()}
                for rp, results in runs.items():
                    for i, r in enumerate(results):
                        rows.append([
                            str(count), "default" if rp else "False", str(i),
                            f"{r['sent'] / 2**20:.2f} MiB ({r['sent'] / state:.3f} x)",
                            f"{r['fetched'] / 2**20:.2f} MiB ({r['fetched'] / state:.3f} x)",
                            f"{r['save_s']:.2f} s", f"{r['restore_s']:.2f} s",
                            f"{ratios['save_s']:.2f}x / {ratios['restore_s']:.2f}x" if rp else "",
                        ])  # fmt: skip
        finally:
            server.stop(remove=True)
    print_table(
        f"replicated float32 state of {args.mib} MiB, SeaweedFS on 127.0.0.1, each process "
        f"capped at {args.rate_mib} MiB/s each way; medians of {args.repeats}",
        ["N", "replica_parallel", "process", "sent / save (x state)", "fetched / restore",
         "save", "restore", "faster (save / restore)"],
        rows,
    )  # fmt: skip
    print(json.dumps(summary))


def run_job(count: int, mib: int, repeats: int, method: str = "eqx_train") -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    directory = tempfile.mkdtemp(prefix="eqx_train_mp_bench_")
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                str(i),
                str(count),
                port,
                str(mib),
                str(repeats),
                directory,
                method,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(count)
    ]
    outputs = [p.communicate(timeout=900)[0] for p in processes]
    subprocess.run(["rm", "-rf", directory], check=False)
    line = [ln for ln in outputs[0].splitlines() if ln.startswith("{")][-1]
    return json.loads(line)["seconds"]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--replicated-worker":
        pid, count, port, mib, repeats, url, rp = sys.argv[2:9]
        replicated_worker(int(pid), int(count), port, int(mib), int(repeats), url, rp == "1")
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        pid, count, port, mib, repeats, directory, method = sys.argv[2:9]
        worker(int(pid), int(count), port, int(mib), int(repeats), directory, method)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--replicated", action="store_true")
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rate-mib", type=float, default=8.0)
    args = parser.parse_args()
    if args.replicated:
        replicated_main(args)
        return
    one = run_job(1, args.mib, args.repeats)
    two = run_job(2, args.mib, args.repeats)
    try:
        import orbax.checkpoint  # noqa: F401

        orbax_two: float | None = run_job(2, args.mib, args.repeats, "orbax")
    except (ImportError, subprocess.SubprocessError, IndexError, ValueError):
        orbax_two = None
    gib = args.mib / 1024
    print(f"\nsave of {args.mib} MiB sharded over 4 CPU devices, median of {args.repeats}")
    print(f"1 process x 4 devices : {one * 1e3:8.0f} ms  {gib / one:6.2f} GiB/s")
    print(f"2 processes x 2 devices: {two * 1e3:8.0f} ms  {gib / two:6.2f} GiB/s aggregate")
    if orbax_two is not None:
        print(f"orbax, 2 processes     : {orbax_two * 1e3:8.0f} ms  {gib / orbax_two:6.2f} GiB/s")
    scaling = (gib / two) / (2 * gib / one)
    summary = {
        "benchmark": "multiprocess_checkpoints",
        "one_process_s": round(one, 3),
        "two_process_s": round(two, 3),
        "aggregate_vs_twice_single": round(scaling, 3),
    }
    if orbax_two is not None:
        summary["orbax_two_process_vs_ours"] = round(orbax_two / two, 2)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
