"""The readers of the layouts this layer reads, registered with the checkpoint package so
that `plan_restore` plans a flax or Orbax path through the restore's own matcher (the
checkpoint package imports this module by name on first need, never the layer itself)."""

from __future__ import annotations

from typing import Any

from ..checkpoints.engine import FOREIGN_READERS, calling
from ._flax_load import FlaxReader, resolve_flax_path
from ._orbax import OrbaxReader
from ._orbax_layout import resolve as resolve_orbax


def _flax(path: str, prefix: str) -> Any:
    return FlaxReader(resolve_flax_path(path, prefix))


def _orbax(path: str, prefix: str) -> Any:
    with calling("plan_restore"):
        return OrbaxReader(resolve_orbax(path, None))


FOREIGN_READERS.update(flax=_flax, orbax=_orbax)
