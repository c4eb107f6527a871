"""Crash-safe safetensors checkpoints with `flax.training.checkpoints`' API
(one file per step, or per-process shards)."""

from typing import TYPE_CHECKING

from .._lazy import exports

if TYPE_CHECKING:
    from ._api import (
        available_steps as available_steps,
        latest_checkpoint as latest_checkpoint,
        restore_checkpoint as restore_checkpoint,
        save_checkpoint as save_checkpoint,
        save_checkpoint_multiprocess as save_checkpoint_multiprocess,
    )
    from ._errors import (
        CheckpointFormatError as CheckpointFormatError,
        NewerFormatError as NewerFormatError,
    )
    from ._plan import RestorePlan as RestorePlan, plan_restore as plan_restore
    from .format._legacy import convert_pre_linen as convert_pre_linen
    from .manager._fallback import UnreadableCheckpointWarning as UnreadableCheckpointWarning
    from .manager._manager import CheckpointManager as CheckpointManager
    from .pipeline._async import AsyncManager as AsyncManager
    from .pipeline._matching import PartialRestoreWarning as PartialRestoreWarning
    from .pipeline._multiprocess import BarrierTimeoutError as BarrierTimeoutError
    from .pipeline._selection import ConfigMismatchWarning as ConfigMismatchWarning
    from .storage import register_storage as register_storage

# Loaded on first use, so that `python -m eqx_train` starts without importing JAX.
__getattr__, __dir__ = exports(
    __name__,
    {
        "AsyncManager": "pipeline._async",
        "BarrierTimeoutError": "pipeline._multiprocess",
        "CheckpointFormatError": "_errors",
        "CheckpointManager": "manager._manager",
        "ConfigMismatchWarning": "pipeline._selection",
        "NewerFormatError": "_errors",
        "PartialRestoreWarning": "pipeline._matching",
        "RestorePlan": "_plan",
        "UnreadableCheckpointWarning": "manager._fallback",
        "available_steps": "_api",
        "convert_pre_linen": "format._legacy",
        "latest_checkpoint": "_api",
        "plan_restore": "_plan",
        "register_storage": "storage",
        "restore_checkpoint": "_api",
        "save_checkpoint": "_api",
        "save_checkpoint_multiprocess": "_api",
    },
)

__all__ = [
    "AsyncManager",
    "BarrierTimeoutError",
    "CheckpointFormatError",
    "CheckpointManager",
    "ConfigMismatchWarning",
    "NewerFormatError",
    "PartialRestoreWarning",
    "RestorePlan",
    "available_steps",
    "convert_pre_linen",
    "latest_checkpoint",
    "plan_restore",
    "register_storage",
    "restore_checkpoint",
    "save_checkpoint",
    "save_checkpoint_multiprocess",
    "UnreadableCheckpointWarning",
]
