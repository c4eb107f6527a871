"""The options of a restore into a target, checked once where a public call takes them, and
the one restore path every reader of another layout goes through (`load_sharded`,
`load_orbax_checkpoint`, `load_flax_checkpoint`): a new matching option is one field here
and one keyword in each of those calls."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .pipeline import _matching, _restore, _selection, _transform, _window
from .pipeline._window import DEFAULT_HOST_WINDOW_BYTES


@dataclass(frozen=True)
class RestoreOptions:
    """How a checkpoint fills a target, as `restore_checkpoint`'s keywords of the same names
    say."""

    strict: bool = True
    rename: _matching.Rename = None
    casting: _matching.Casting = "no"
    filter_spec: Any = None
    transform: _transform.Transform = None
    config: _selection.Config = "target"
    verify: bool = True
    parallel: bool = True
    host_window_bytes: int = DEFAULT_HOST_WINDOW_BYTES

    def check(self, caller: str, target: Any) -> RestoreOptions:
        """Raises, naming `caller`, for an option of the wrong kind (or one that applies to a
        target's leaves given with `target=None`); returns the options."""
        _selection.check_config(self.config, caller)
        _matching.check_options(
            self.casting,
            self.rename,
            caller,
            target=target,
            filter_spec=self.filter_spec,
            transform=self.transform,
        )
        _window.check_window(self.host_window_bytes, caller)
        return self


def restore_with(reader: Any, target: Any, options: RestoreOptions, caller: str) -> Any:
    """`target` filled from an open `reader` (any layout) by the restore's own matcher and
    reader, as `restore_checkpoint` fills it."""
    return _restore.restore_from(reader, target, caller=caller, **dataclasses.asdict(options))
