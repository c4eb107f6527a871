"""Multi-device utilities with `flax.jax_utils`' API, for Equinox models on today's JAX.

Two tracks. The **pmap track** is flax's: `replicate` / `unreplicate` move whole pytrees
with one transfer per call, keep the non-array leaves of Equinox modules, and never gather
replicas; `pad_shard_unpad` runs a pmapped function on any batch size; `prefetch_to_device`,
`pmean` and `partial_eval_by_shape` complete flax's set. The **mesh track** (`jax.jit` over
a `Mesh`) uses the same names where they fit (`prefetch_to_device` with a sharding,
`pad_shard_unpad(mesh=...)`), JAX's own one-liners where JAX has them (replicating a state
is `eqx.filter_shard(state, NamedSharding(mesh, PartitionSpec()))`), and `fsdp_sharding`
for parameters and optimiser state sharded over a mesh axis. Built on public JAX APIs only.
"""

from ._jax_utils_fsdp import fsdp_sharding as fsdp_sharding
from ._jax_utils_pad import pad_shard_unpad as pad_shard_unpad
from ._jax_utils_partial_eval import partial_eval_by_shape as partial_eval_by_shape
from ._jax_utils_replicate import (
    pmean as pmean,
    prefetch_to_device as prefetch_to_device,
    replicate as replicate,
    unreplicate as unreplicate,
)

__all__ = [
    "fsdp_sharding",
    "pad_shard_unpad",
    "partial_eval_by_shape",
    "pmean",
    "prefetch_to_device",
    "replicate",
    "unreplicate",
]
