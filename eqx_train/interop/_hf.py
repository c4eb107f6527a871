"""The Hugging Face sharded safetensors layout (`model-0000k-of-0000N.safetensors` + index)."""

from __future__ import annotations

import os
from typing import Any


def save_sharded(
    directory: str | os.PathLike[str], tree: Any, *, max_shard_size: int | str = "5GB"
) -> None:
    """Placeholder: implemented under issue 14."""
    raise NotImplementedError("save_sharded is not implemented yet")


def load_sharded(directory: str | os.PathLike[str], target: Any = None) -> Any:
    """Placeholder: implemented under issue 14."""
    raise NotImplementedError("load_sharded is not implemented yet")
