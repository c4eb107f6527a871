"""replicate / unreplicate / pad_shard_unpad speed on 8 simulated devices, vs flax.

    python benchmarks/jax_utils.py

- replicate a 64 MiB tree (16 float32 leaves): eqx_train vs flax's `replicate`, with one
  `jax.device_put` to a replicated sharding as the transfer floor;
- unreplicate it: eqx_train vs flax's `unreplicate` vs `x[0]` on the global array;
- pad_shard_unpad on an uneven batch vs the same pmap on a pre-padded, pre-sharded batch
  (both bring the result to the host).
Medians of repeated runs; ratios are against a reference measured in the same run.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _timing import median_seconds, print_table  # noqa: E402
from flax import jax_utils as flax_jax_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from eqx_train import jax_utils  # noqa: E402


def timed(fn, repeats=15, number=1):
    jax.block_until_ready(fn())
    return median_seconds(lambda: jax.block_until_ready(fn()), repeats=repeats, number=number)


def main() -> None:
    leaves = 16
    tree = {
        f"w{i}": np.random.default_rng(i).standard_normal(
            64 * 2**20 // 4 // leaves, dtype=np.float32
        )
        for i in range(leaves)
    }
    devices = jax.local_devices()
    mesh = Mesh(np.array(devices), ("d",))
    replicated_sharding = NamedSharding(mesh, PartitionSpec())

    rep = {
        "flax replicate": timed(lambda: flax_jax_utils.replicate(tree)),
        "jax.device_put(tree, replicated)": timed(
            lambda: jax.device_put(tree, replicated_sharding)
        ),
        "eqx_train replicate": timed(lambda: jax_utils.replicate(tree)),
    }
    replicated = jax_utils.replicate(tree)
    unrep = {
        "x[0] on the global array": timed(lambda: jax.tree.map(lambda x: x[0], replicated)),
        "flax unreplicate": timed(lambda: flax_jax_utils.unreplicate(replicated)),
        "eqx_train unreplicate": timed(lambda: jax_utils.unreplicate(replicated)),
    }

    w = jnp.ones((256, 256))
    forward = jax.pmap(lambda w, x: jnp.tanh(x @ w), in_axes=(None, 0))
    batch = 1000  # 8 devices x 125 rows once the 997-row batch is padded
    uneven = np.random.default_rng(0).standard_normal((batch - 3, 256), dtype=np.float32)
    padded = np.concatenate([uneven, np.zeros((3, 256), np.float32)]).reshape(8, 125, 256)
    wrapped = jax_utils.pad_shard_unpad(forward)
    pad = {
        "pmap on pre-padded, pre-sharded batch": timed(
            lambda: np.asarray(forward(w, padded)), repeats=40, number=5
        ),
        "flax pad_shard_unpad(pmap), uneven batch": timed(
            lambda: flax_jax_utils.pad_shard_unpad(forward)(w, uneven), repeats=40, number=5
        ),
        "eqx_train pad_shard_unpad(pmap), uneven batch": timed(
            lambda: wrapped(w, uneven), repeats=40, number=5
        ),
    }

    rows = []
    for title, results, reference in (
        ("replicate 64 MiB", rep, "flax replicate"),
        ("unreplicate 64 MiB", unrep, "flax unreplicate"),
        ("pad_shard_unpad", pad, "pmap on pre-padded, pre-sharded batch"),
    ):
        for name, seconds in results.items():
            rows.append(
                [
                    title,
                    name,
                    f"{seconds * 1e3:8.2f}",
                    f"{seconds / results[reference]:5.2f}x vs {reference.split()[0]}",
                ]
            )
    print_table(
        f"jax_utils, {len(devices)} {devices[0].platform} devices, medians",
        ["operation", "variant", "ms", "ratio"],
        rows,
    )
    summary = {
        "flax_replicate_vs_ours": round(rep["flax replicate"] / rep["eqx_train replicate"], 2),
        "ours_replicate_vs_device_put": round(
            rep["eqx_train replicate"] / rep["jax.device_put(tree, replicated)"], 2
        ),
        "unreplicate_ms": round(unrep["eqx_train unreplicate"] * 1e3, 3),
        "flax_unreplicate_ms": round(unrep["flax unreplicate"] * 1e3, 3),
        "pad_shard_unpad_vs_prepadded": round(
            pad["eqx_train pad_shard_unpad(pmap), uneven batch"]
            / pad["pmap on pre-padded, pre-sharded batch"],
            3,
        ),
    }
    print(json.dumps({"benchmark": "jax_utils", **summary}))


if __name__ == "__main__":
    main()
