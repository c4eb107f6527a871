"""The options of a save and of a restore, checked once where a public call takes them
(`pipeline._options`, where the stages below take them whole), and the one restore path
every reader of another layout goes through (`load_sharded`, `load_orbax_checkpoint`,
`load_flax_checkpoint`): a new matching option is one field of `RestoreOptions` and one
keyword in each of those calls."""

from __future__ import annotations

from typing import Any

from .pipeline import _restore
from .pipeline._options import RestoreOptions as RestoreOptions, SaveOptions as SaveOptions


def restore_with(reader: Any, target: Any, options: RestoreOptions) -> Any:
    """`target` filled from an open `reader` (any layout) by the restore's own matcher and
    reader, as `restore_checkpoint` fills it; errors name the public call in progress."""
    return _restore.restore_from(reader, target, options=options)
