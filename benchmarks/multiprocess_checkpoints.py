"""Aggregate multi-process save throughput vs one process, on loopback.

    python benchmarks/multiprocess_checkpoints.py [--mib 512] [--repeats 5]

Saves one float32 array of `--mib` MiB sharded over 4 CPU devices: once from a single process
holding all 4 devices, and once from 2 `jax.distributed` processes with 2 devices each (each
writes half). Reports medians and the ratio of the 2-process aggregate throughput to twice
the single-process throughput (1.0 would be perfect scaling).
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
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        pid, count, port, mib, repeats, directory, method = sys.argv[2:9]
        worker(int(pid), int(count), port, int(mib), int(repeats), directory, method)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
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
