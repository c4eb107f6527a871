"""The options of a save and of a restore, as frozen objects: a public call checks its
keyword arguments once into one of these, and every stage below takes it whole.

A new option is one field here, its check in `check`, and one keyword in each public call
that offers it; no stage re-spells the list. This module imports only the pipeline's leaf
modules, so that every stage may import it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..._calls import call
from ..._progress import Progress, check_progress
from ..format import _names
from . import _selection, _transform, _window
from ._rename import Rename
from ._window import DEFAULT_HOST_WINDOW_BYTES

Casting = Literal["no", "equiv", "safe", "same_kind", "unsafe"]
CASTINGS: tuple[Casting, ...] = ("no", "equiv", "safe", "same_kind", "unsafe")
SnapshotMode = Literal["auto", "device", "host"]
SNAPSHOT_MODES: tuple[str, ...] = ("auto", "device", "host")
# Given the checkpoints (one entry per step, oldest first), the step texts to delete.
Retention = Callable[[list[Any]], list[str]]


def keep_newest(entries: list[Any]) -> list[str]:
    """The default retention, flax's `keep=1`: every step but the newest."""
    return [entry.text for entry in entries[:-1]]


@dataclass(frozen=True)
class RestoreOptions:
    """How a checkpoint fills a target, as `restore_checkpoint`'s keywords of the same names
    say (`threaded_reads` is its `parallel`: read several whole tensors of a local file at
    once, each in its own thread)."""

    strict: bool = True
    rename: Rename = None
    casting: Casting = "no"
    filter_spec: Any = None
    transform: _transform.Transform = None
    config: _selection.Config = "target"
    verify: bool = True
    threaded_reads: bool = True
    host_window_bytes: int = DEFAULT_HOST_WINDOW_BYTES
    replica_parallel: bool = True
    progress: Progress = None

    def check(self, target: Any) -> RestoreOptions:
        """Raises, naming the public call in progress, for an option of the wrong kind (or
        one that applies to a target's leaves given with `target=None`); returns the
        options."""
        _selection.check_config(self.config)
        check_matching(self.casting, self.rename, target, self.filter_spec, self.transform)
        _window.check_window(self.host_window_bytes)
        check_progress(self.progress, call())
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
    retention: Retention = keep_newest
    snapshot: SnapshotMode = "auto"
    host_window_bytes: int = DEFAULT_HOST_WINDOW_BYTES
    filter_spec: Any = None
    multiprocess: bool = False
    timeout_s: int | float = 300.0
    replica_parallel: bool = True
    extra_metadata: dict[str, str] | Callable[[], dict[str, str]] | None = None
    progress: Progress = None

    def check(self) -> SaveOptions:
        """Raises, naming the public call in progress, for an option of the wrong kind;
        returns the options. Run inside the save, where a multi-process save reports the
        error of one process to all."""
        check_snapshot(self.snapshot, self.host_window_bytes)
        _names.check_prefix(self.prefix)
        check_progress(self.progress, call())
        return self


def check_snapshot(snapshot: Any, host_window_bytes: Any) -> None:
    """Refuses a `snapshot` mode or a `host_window_bytes` that is not one we know."""
    if snapshot not in SNAPSHOT_MODES:
        raise ValueError(
            f"{call()}: snapshot must be one of {', '.join(map(repr, SNAPSHOT_MODES))}, got "
            f"{snapshot!r}."
        )
    _window.check_window(host_window_bytes)


def check_matching(
    casting: Any, rename: Any, target: Any, filter_spec: Any, transform: Any
) -> None:
    """Refuses a `casting`, `rename` or `transform` of the wrong kind, and any of `rename`,
    `casting`, `filter_spec`, `transform` given with `target=None` (which loads the file
    as saved: they would be ignored)."""
    if target is None:
        given = [
            name
            for name, is_set in [
                ("rename", rename is not None),
                ("casting", casting != "no"),
                ("filter_spec", filter_spec is not None),
                ("transform", transform is not None),
            ]
            if is_set
        ]
        if given:
            raise ValueError(
                f"{call()}: {', '.join(given)} applies to a target's leaves, but "
                "target=None loads the file as saved; pass the target to restore into."
            )
    if casting not in CASTINGS:
        raise ValueError(f"{call()}: casting must be one of {CASTINGS}, got {casting!r}.")
    _transform.check_transform(transform)
    if rename is None or callable(rename):
        return
    if not isinstance(rename, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in rename.items()
    ):
        raise TypeError(
            f"{call()}: rename must be a mapping of target name prefixes to saved name "
            f"prefixes (str -> str) or a function name -> saved name or None, got {rename!r}."
        )
