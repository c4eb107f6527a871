"""Crash-safe safetensors checkpoints with `flax.training.checkpoints`' API
(one file per step, or per-process shards)."""

from ._async import AsyncManager as AsyncManager
from ._checkpoints import (
    available_steps as available_steps,
    latest_checkpoint as latest_checkpoint,
    restore_checkpoint as restore_checkpoint,
    save_checkpoint as save_checkpoint,
    save_checkpoint_multiprocess as save_checkpoint_multiprocess,
)
from ._format import CheckpointFormatError as CheckpointFormatError
from ._legacy import convert_pre_linen as convert_pre_linen
from ._manager import (
    CheckpointManager as CheckpointManager,
    UnreadableCheckpointWarning as UnreadableCheckpointWarning,
)
from ._multiprocess import BarrierTimeoutError as BarrierTimeoutError

__all__ = [
    "AsyncManager",
    "BarrierTimeoutError",
    "CheckpointFormatError",
    "CheckpointManager",
    "available_steps",
    "convert_pre_linen",
    "latest_checkpoint",
    "restore_checkpoint",
    "save_checkpoint",
    "save_checkpoint_multiprocess",
    "UnreadableCheckpointWarning",
]
