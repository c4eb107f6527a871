"""docs/multi_host.md runs as the page says: its code blocks, in order, in every process of a
real 2-process `jax.distributed` job on 127.0.0.1 (2 CPU devices per process)."""

import json
import os
import re
import sys
from typing import cast

import numpy as np
import pytest

from tests.support.helpers import free_port, run_processes, worker_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 120

# One process of the job: the page's blocks, then checks of what they restored.
WORKER = """
import sys

import jax
import numpy as np

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 2)
sys.path.insert(0, sys.argv[1])
from tests.test_docs_examples import _blocks

page = "docs/multi_host.md"
with open(f"{sys.argv[1]}/{page}") as f:
    blocks = _blocks(f.read(), page)
assert len(blocks) == 3 and all(marker for _, marker, _ in blocks), blocks
namespace = {"__name__": "__main__"}
for line, _, code in blocks:
    exec(compile("\\n" * (line - 1) + code, page, "exec"), namespace)

restored = namespace["restored"]
assert restored["step"] == 1000 and jax.process_count() == 2
w, b = restored["params"]["w"], restored["params"]["b"]
assert w.sharding.mesh.devices.shape == (2, 2) and len(w.addressable_shards) == 2
expected_w = np.arange(32, dtype=np.float32).reshape(8, 4)
for shard in w.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), expected_w[shard.index])
    assert shard.data.shape == (4, 2)  # a 2 x 2 block grid over (8, 4)
for shard in b.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), np.zeros(4, np.float32))
print(f"OK {jax.process_index()}", flush=True)
jax.distributed.shutdown()
"""


@pytest.mark.slow
def test_multi_host_page_saves_and_reshards_across_two_processes(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    env = worker_env(
        COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}", NUM_PROCESSES="2", CKPT_DIR=str(ckpt_dir)
    )
    results = run_processes(
        [([sys.executable, "-c", WORKER, ROOT], {**env, "PROCESS_ID": str(r)}) for r in range(2)],
        TIMEOUT_S,
    )
    for rank, (returncode, out) in enumerate(results):
        assert f"OK {rank}" in out, f"process {rank} exited {returncode}:\n{out[-3000:]}"
    # Each process wrote its own shards; process 0 the index.
    files = sorted(os.listdir(ckpt_dir / "checkpoint_1000.shards"))
    assert files[0] == "index.safetensors" and len(files) == 3, files
    assert [
        cast(re.Match, re.fullmatch(r"process_0000([01])\.[0-9a-f-]+\.safetensors", f))[1]
        for f in files[1:]
    ] == [
        "0",
        "1",
    ]
    # 'b', replicated on both processes, was written half by each (as the page's table says).
    with open(ckpt_dir / "checkpoint_1000.shards" / "index.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    pieces = json.loads(header["__metadata__"]["eqx_train.arrays"])["params.b"]["pieces"]
    assert sorted((p["file"][:13], p["index"]) for p in pieces) == [
        ("process_00000", [[0, 2]]),
        ("process_00001", [[2, 4]]),
    ]
    # A single process reads the whole checkpoint back as saved.
    from eqx_train import checkpoints

    as_saved = checkpoints.restore_checkpoint(ckpt_dir, None)
    np.testing.assert_array_equal(
        as_saved["params"]["w"], np.arange(32, dtype=np.float32).reshape(8, 4)
    )
    assert as_saved["step"] == 1000
