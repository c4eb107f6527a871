"""Reading flax.training msgpack checkpoints without flax."""

from __future__ import annotations

import os
from typing import Any


def load_flax_checkpoint(path: str | os.PathLike[str]) -> Any:
    """Placeholder: implemented under issue 14."""
    raise NotImplementedError("load_flax_checkpoint is not implemented yet")
