"""Crash-safe safetensors checkpoints with `flax.training.checkpoints`' API
(one file per step, or per-process shards)."""

from typing import TYPE_CHECKING

from .._lazy import exports

if TYPE_CHECKING:
    from ._api import (
        available_steps as available_steps,
        latest_checkpoint as latest_checkpoint,
        save_checkpoint as save_checkpoint,
        save_checkpoint_multiprocess as save_checkpoint_multiprocess,
    )
    from ._errors import (
        BarrierTimeoutError as BarrierTimeoutError,
        CheckpointFormatError as CheckpointFormatError,
        ConfigMismatchWarning as ConfigMismatchWarning,
        NewerFormatError as NewerFormatError,
        PartialRestoreWarning as PartialRestoreWarning,
        StepExistsError as StepExistsError,
        StepNotFoundError as StepNotFoundError,
        UnreadableCheckpointWarning as UnreadableCheckpointWarning,
    )
    from ._plan import RestorePlan as RestorePlan, plan_restore as plan_restore
    from ._restore_api import restore_checkpoint as restore_checkpoint
    from .format._legacy import convert_pre_linen as convert_pre_linen
    from .manager._manager import CheckpointManager as CheckpointManager
    from .manager._retention_policy import (
        KeepAny as KeepAny,
        KeepBest as KeepBest,
        KeepEveryNSteps as KeepEveryNSteps,
        KeepLatest as KeepLatest,
        RetentionContext as RetentionContext,
        RetentionPolicy as RetentionPolicy,
    )
    from .manager._save_policy import (
        SaveAny as SaveAny,
        SaveContext as SaveContext,
        SaveEveryNSeconds as SaveEveryNSeconds,
        SaveEveryNSteps as SaveEveryNSteps,
        SaveOnPreemption as SaveOnPreemption,
        SavePolicy as SavePolicy,
    )
    from .manager._tiers import LastRestore as LastRestore
    from .pipeline._async import AsyncManager as AsyncManager
    from .storage import register_storage as register_storage

# Loaded on first use, so that `python -m eqx_train` starts without importing JAX.
__getattr__, __dir__ = exports(
    __name__,
    {
        "AsyncManager": "pipeline._async",
        "BarrierTimeoutError": "_errors",
        "CheckpointFormatError": "_errors",
        "CheckpointManager": "manager._manager",
        "ConfigMismatchWarning": "_errors",
        "KeepAny": "manager._retention_policy",
        "KeepBest": "manager._retention_policy",
        "KeepEveryNSteps": "manager._retention_policy",
        "KeepLatest": "manager._retention_policy",
        "LastRestore": "manager._tiers",
        "NewerFormatError": "_errors",
        "PartialRestoreWarning": "_errors",
        "RestorePlan": "_plan",
        "RetentionContext": "manager._retention_policy",
        "RetentionPolicy": "manager._retention_policy",
        "SaveAny": "manager._save_policy",
        "SaveContext": "manager._save_policy",
        "SaveEveryNSeconds": "manager._save_policy",
        "SaveEveryNSteps": "manager._save_policy",
        "SaveOnPreemption": "manager._save_policy",
        "SavePolicy": "manager._save_policy",
        "StepExistsError": "_errors",
        "StepNotFoundError": "_errors",
        "UnreadableCheckpointWarning": "_errors",
        "available_steps": "_api",
        "convert_pre_linen": "format._legacy",
        "latest_checkpoint": "_api",
        "plan_restore": "_plan",
        "register_storage": "storage",
        "restore_checkpoint": "_restore_api",
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
    "KeepAny",
    "KeepBest",
    "KeepEveryNSteps",
    "KeepLatest",
    "NewerFormatError",
    "PartialRestoreWarning",
    "RestorePlan",
    "RetentionContext",
    "RetentionPolicy",
    "SaveAny",
    "SaveContext",
    "SaveEveryNSeconds",
    "SaveEveryNSteps",
    "SaveOnPreemption",
    "SavePolicy",
    "StepExistsError",
    "StepNotFoundError",
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
