"""Worker for tests/test_interop_orbax.py: one JAX process of a loopback job saving an
Orbax checkpoint with orbax itself.

    python orbax_worker.py PROCESS_ID NUM_PROCESSES PORT DIR

Each process has 2 CPU devices; the arrays are sharded over all of them. Prints
"OK orbax_save <process>" on success; any failure is an exception (non-zero exit).
"""

import os
import sys

pid, count, port, directory = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}", num_processes=count, process_id=pid
)
import orbax.checkpoint as ocp  # noqa: E402

from tests.support.orbax_values import two_process_values  # noqa: E402

mesh = Mesh(np.array(jax.devices()).reshape(count, 2), ("hosts", "local"))


def place(x, spec):
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])


values = two_process_values()
tree = {
    "w": place(values["w"], P("hosts", "local")),
    "rows": place(values["rows"], P(("hosts", "local"))),
    "half": place(values["half"], P(None, "hosts")),
    "replicated": place(values["replicated"], P()),
    "step": 7,
}
assert values["half"].dtype == ml_dtypes.bfloat16
with ocp.CheckpointManager(directory) as manager:
    manager.save(7, args=ocp.args.StandardSave(tree))
    manager.wait_until_finished()
print(f"OK orbax_save {pid}", flush=True)
