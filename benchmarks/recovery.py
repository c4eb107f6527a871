"""The recovery time after losing one host, against the persistent restore of the same step.

    python benchmarks/recovery.py [--processes 4] [--mib 64] [--repeats 3] [--rate-mib 0]
        [--persistent DIR] [--platform cpu|gpu]

`--processes` real `jax.distributed` processes on loopback (one device each: CPU with gloo
collectives, or the GPUs when `--platform gpu` and each process sees one) hold a float32
state of `--mib` MiB sharded across them. One job saves it at step 1 to both tiers: the
local tier on a RAM disk (`/dev/shm`), the persistent tier on a SeaweedFS S3 bucket on
127.0.0.1 (or `--persistent DIR`, a local directory, where SeaweedFS is missing), each
process reaching it through its own loopback proxy, capped at `--rate-mib` MiB/s each way
as a host's network link would be (0: uncapped). Then, for
each repeat, three fresh jobs restore it:

- **lost host**: process 1's local directory deleted (a replaced host): process 1 receives
  its unit from its peer over the collective, the others read their own;
- **all local**: every local directory intact;
- **persistent**: every local directory deleted: every process reads the persistent tier.

Reported: the median over repeats of the slowest process's `last_restore.seconds` (the job
resumes when its slowest process has), per scenario, and the ratio of the persistent restore
to the lost-host one. The time to start the processes and JAX is the same in every scenario
and left out, as is JAX's one-time import of its compiler (a training job has compiled its
step before it restores: each worker runs one small jitted function first); the compile of
the peer transfer's collective is in. Prints a table and a one-line JSON summary.
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
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def worker(args: argparse.Namespace) -> None:
    pid, count = args.pid, args.processes
    if args.platform == "cpu":
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if args.platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    local_device = [pid] if args.platform == "gpu" else None
    jax.distributed.initialize(
        f"127.0.0.1:{args.port}",
        num_processes=count,
        process_id=pid,
        local_device_ids=local_device,
    )
    from eqx_train.checkpoints import CheckpointManager

    rows = max(count, (args.mib << 20) // (4 * 1024) // count * count)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    state = {
        "w": jax.make_array_from_callback(
            (rows, 1024), sharding, lambda i: np.full((rows, 1024), 1.5, np.float32)[i]
        )
    }
    mgr = CheckpointManager(
        args.persistent,
        local_directory=os.path.join(args.local, f"local_{pid}"),
        storage_options=json.loads(args.storage_options) or None,
        timeout_s=600,
    )
    if args.mode == "save":
        mgr.save(1, state, host_state={"process": pid})
        mgr.close()
    else:
        target = {
            "w": jax.make_array_from_callback(
                (rows, 1024), sharding, lambda i: np.zeros((rows, 1024), np.float32)[i]
            )
        }
        jax.block_until_ready(target)
        # A training job has compiled its step before it ever restores: JAX's one-time
        # import of its compiler (~0.6 s here) is left out, the transfer's compile is not.
        jax.block_until_ready(jax.jit(lambda x: x + 1)(target["w"]))
        mgr.restore(target)
        last = mgr.last_restore
        assert last is not None and last.step == 1, last
        print(
            "RESULT "
            + json.dumps({"tier": last.tier, "seconds": last.seconds, "bytes": last.bytes_read}),
            flush=True,
        )


def _job(args: argparse.Namespace, mode: str, storage_options: list[dict[str, Any]]) -> list[dict]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                mode,
                "--pid",
                str(i),
                "--port",
                str(port),
                "--processes",
                str(args.processes),
                "--mib",
                str(args.mib),
                "--persistent",
                args.persistent,
                "--local",
                args.local,
                "--platform",
                args.platform,
                "--storage-options",
                json.dumps(storage_options[i]),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for i in range(args.processes)
    ]
    results = []
    for i, process in enumerate(processes):
        out: str = process.communicate(timeout=900)[0] or ""
        if process.returncode != 0:
            raise SystemExit(f"process {i} of the {mode} job failed:\n{out[-3000:]}")
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        results += [json.loads(line.removeprefix("RESULT ")) for line in lines]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--persistent", default="")
    parser.add_argument("--local", default="")
    parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--worker", default="")
    parser.add_argument("--pid", type=int, default=0)
    parser.add_argument("--port", default="")
    parser.add_argument("--storage-options", default="{}")
    parser.add_argument("--rate-mib", type=float, default=0.0)
    args = parser.parse_args()
    if args.worker:
        args.mode = args.worker
        worker(args)
        return
    ram = "/dev/shm" if os.path.isdir("/dev/shm") else None
    args.local = tempfile.mkdtemp(prefix="eqx_train-local-", dir=ram)
    server, storage_options, store, proxies = None, [{}] * args.processes, "local directory", []
    try:
        if not args.persistent:
            try:
                from tests.support.fault_proxy import FaultProxy
                from tests.support.s3_server import SeaweedS3

                server = SeaweedS3().__enter__()
                server.create_bucket("recovery")
                args.persistent, store = "s3://recovery/run", "SeaweedFS S3 on 127.0.0.1"
                # Each process reaches the bucket through its own link, as a host would.
                rate = args.rate_mib * 2**20 or None
                proxies = [FaultProxy(server.endpoint_url, rate_bytes_per_s=rate)
                           for _ in range(args.processes)]  # fmt: skip
                storage_options = [
                    {**server.storage_options,
                     "client_kwargs": {**server.storage_options["client_kwargs"],
                                       "endpoint_url": proxy.url}}
                    for proxy in proxies
                ]  # fmt: skip
                if args.rate_mib:
                    store += f", each process's link capped at {args.rate_mib:g} MiB/s"
            except Exception as error:  # no weed binary: a local directory instead
                print(f"(no S3 server: {error}; the persistent tier is a local directory)")
                args.persistent = tempfile.mkdtemp(prefix="eqx_train-persistent-")
        _job(args, "save", storage_options)
        saved = os.path.join(args.local, "saved")
        shutil.copytree(args.local, saved + ".tmp")
        os.rename(saved + ".tmp", saved)
        times: dict[str, list[float]] = {"lost host": [], "all local": [], "persistent": []}
        tiers: dict[str, list[str]] = {}
        for _ in range(args.repeats):
            for scenario, lost in (
                ("lost host", [1]),
                ("all local", []),
                ("persistent", list(range(args.processes))),
            ):
                for i in range(args.processes):
                    here = os.path.join(args.local, f"local_{i}")
                    shutil.rmtree(here, ignore_errors=True)
                    if i not in lost:
                        shutil.copytree(os.path.join(saved, f"local_{i}"), here)
                results = _job(args, "restore", storage_options)
                times[scenario].append(max(r["seconds"] for r in results))
                tiers[scenario] = [r["tier"] for r in results]
    finally:
        for proxy in proxies:
            proxy.close()
        if server is not None:
            server.__exit__(None, None, None)
        shutil.rmtree(args.local, ignore_errors=True)
    medians = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"{args.processes} processes ({args.platform}), {args.mib} MiB state sharded "
        f"across them; local tier on {ram or 'a temporary directory'}, persistent on "
        f"{store}; medians of {args.repeats}, the slowest process's restore"
    )
    print("| scenario | tiers (per process) | restore |")
    print("| --- | --- | --- |")
    for scenario, seconds in medians.items():
        print(f"| {scenario} | {', '.join(tiers[scenario])} | {seconds * 1000:.0f} ms |")
    ratio = medians["persistent"] / medians["lost host"]
    print(f"persistent / lost host: {ratio:.1f}x")
    print(
        json.dumps(
            {
                "benchmark": "recovery",
                "processes": args.processes,
                "mib": args.mib,
                "platform": args.platform,
                "persistent_store": store,
                "seconds": medians,
                "persistent_over_lost_host": ratio,
            }
        )
    )


if __name__ == "__main__":
    main()
