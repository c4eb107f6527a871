"""eqx_train: flax.training's toolkit for JAX + Equinox, as immutable, typed pytrees."""

import importlib.metadata
from typing import TYPE_CHECKING

from ._lazy import exports

if TYPE_CHECKING:
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
        numpy_rng_from_state as numpy_rng_from_state,
        numpy_rng_state as numpy_rng_state,
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
    from .train_step import jit_step as jit_step, pmap_step as pmap_step

# Loaded on first use, so that `python -m eqx_train` starts without importing JAX.
__getattr__, __dir__ = exports(
    __name__,
    {
        "checkpoints": "checkpoints",
        "common_utils": "common_utils",
        "dynamic_scale": "dynamic_scale",
        "interop": "interop",
        "jax_utils": "jax_utils",
        "lr_schedule": "lr_schedule",
        "get_metrics": "common_utils",
        "numpy_rng_from_state": "common_utils",
        "numpy_rng_state": "common_utils",
        "onehot": "common_utils",
        "shard": "common_utils",
        "shard_prng_key": "common_utils",
        "shard_to_mesh": "common_utils",
        "stack_forest": "common_utils",
        "fsdp_sharding": "jax_utils",
        "pad_shard_unpad": "jax_utils",
        "partial_eval_by_shape": "jax_utils",
        "pmean": "jax_utils",
        "prefetch_to_device": "jax_utils",
        "replicate": "jax_utils",
        "unreplicate": "jax_utils",
        "create_constant_learning_rate_schedule": "lr_schedule",
        "create_cosine_learning_rate_schedule": "lr_schedule",
        "create_stepped_learning_rate_schedule": "lr_schedule",
        "DynamicScale": "dynamic_scale",
        "EarlyStopping": "early_stopping",
        "TrainState": "train_state",
        "jit_step": "train_step",
        "pmap_step": "train_step",
    },
)

__version__ = importlib.metadata.version("eqx_train")
