"""eqx_train: flax.training's toolkit for JAX + Equinox, as immutable, typed pytrees."""

import importlib.metadata

from . import (
    checkpoints as checkpoints,
    common_utils as common_utils,
    dynamic_scale as dynamic_scale,
    interop as interop,
    jax_utils as jax_utils,
    lr_schedule as lr_schedule,
)
from .common_utils import (
    get_metrics as get_metrics,
    onehot as onehot,
    shard as shard,
    shard_prng_key as shard_prng_key,
    shard_to_mesh as shard_to_mesh,
    stack_forest as stack_forest,
)
from .dynamic_scale import DynamicScale as DynamicScale
from .early_stopping import EarlyStopping as EarlyStopping
from .jax_utils import (
    fsdp_sharding as fsdp_sharding,
    pad_shard_unpad as pad_shard_unpad,
    partial_eval_by_shape as partial_eval_by_shape,
    pmean as pmean,
    prefetch_to_device as prefetch_to_device,
    replicate as replicate,
    unreplicate as unreplicate,
)
from .lr_schedule import (
    create_constant_learning_rate_schedule as create_constant_learning_rate_schedule,
    create_cosine_learning_rate_schedule as create_cosine_learning_rate_schedule,
    create_stepped_learning_rate_schedule as create_stepped_learning_rate_schedule,
)
from .train_state import TrainState as TrainState
from .train_step import jit_step as jit_step

__version__ = importlib.metadata.version("eqx_train")
