"""The options of a save and of a restore, as frozen objects: a public call checks its
keyword arguments once into one of these, and every stage below takes it whole.

A new option is one field here, its check in `check`, and one keyword in each public call
that offers it; no stage re-spells the list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._errors import call
from ..format import _names
from . import _directory, _matching, _selection, _snapshot, _transform, _window
from ._snapshot import SnapshotMode
from ._window import DEFAULT_HOST_WINDOW_BYTES


@dataclass(frozen=True)
class RestoreOptions:
    """How a checkpoint fills a target, as `restore_checkpoint`'s keywords of the same names
    say (`threaded_reads` is its `parallel`: read several whole tensors of a local file at
    once, each in its own thread)."""

    strict: bool = True
    rename: _matching.Rename = None
    casting: _matching.Casting = "no"
    filter_spec: Any = None
    transform: _transform.Transform = None
    config: _selection.Config = "target"
    verify: bool = True
    threaded_reads: bool = True
    host_window_bytes: int = DEFAULT_HOST_WINDOW_BYTES
    replica_parallel: bool = True

    def check(self, target: Any) -> RestoreOptions:
        """Raises, naming the public call in progress, for an option of the wrong kind (or
        one that applies to a target's leaves given with `target=None`); returns the
        options."""
        _selection.check_config(self.config)
        _matching.check_options(
            self.casting,
            self.rename,
            target=target,
            filter_spec=self.filter_spec,
            transform=self.transform,
        )
        _window.check_window(self.host_window_bytes)
        return self


@dataclass(frozen=True)
class SaveOptions:
    """How a save writes, as `save_checkpoint`'s and `save_checkpoint_multiprocess`'s
    keywords of the same names say.

    `retention` names the steps to delete once the save is durable (flax's `keep` rule, or
    a manager's); `extra_metadata` is added to the file's metadata (a dict, or a function
    called inside the save, so that a bad value on one process fails the save on all);
    `multiprocess` picks the `.shards` layout, each process writing its own pieces."""

    prefix: str = "checkpoint_"
    overwrite: bool = False
    retention: _directory.Retention = field(
        default_factory=lambda: _directory.flax_retention(1, None)
    )
    snapshot: SnapshotMode = "auto"
    host_window_bytes: int = DEFAULT_HOST_WINDOW_BYTES
    filter_spec: Any = None
    multiprocess: bool = False
    timeout_s: int | float = 300.0
    replica_parallel: bool = True
    extra_metadata: dict[str, str] | Callable[[], dict[str, str]] | None = None

    def check(self) -> SaveOptions:
        """Raises, naming the public call in progress, for an option of the wrong kind;
        returns the options. Run inside the save, where a multi-process save reports the
        error of one process to all."""
        _snapshot.check_options(self.snapshot, self.host_window_bytes)
        _names.check_prefix(self.prefix)
        return self

    def check_storage(self, store_is_local: bool) -> None:
        """Raises for an option the storage rules out (`store_is_local`: whether it is a
        local file system)."""
        if self.multiprocess and not store_is_local and self.timeout_s > _directory.STALE_S / 2:
            # On an object store nobody can tell a live writer's uncommitted pieces from a
            # dead one's but by age: other saves remove them after `STALE_S`.
            raise ValueError(
                f"{call()}: timeout_s={self.timeout_s!r} is too long for an object store; at "
                f"most {_directory.STALE_S / 2:.0f} s, since uncommitted pieces older than "
                f"{_directory.STALE_S:.0f} s count as abandoned."
            )
