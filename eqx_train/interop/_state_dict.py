"""PyTorch-style state dicts: dotted names to arrays, and back into a pytree."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """Placeholder: implemented under issue 14."""

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[str, ...] = ()


def to_state_dict(tree: Any) -> Any:
    """Placeholder: implemented under issue 14."""
    raise NotImplementedError("to_state_dict is not implemented yet")


def from_state_dict(
    target: Any, state_dict: Any, *, key_map: Any = None, strict: bool = True
) -> Any:
    """Placeholder: implemented under issue 14."""
    raise NotImplementedError("from_state_dict is not implemented yet")
