"""A `CheckpointManager`'s options once checked (`_checks.manager_options`): one frozen
object that the manager takes whole, and read-only attributes that show them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Generic, Literal, TypeVar

from ._retention_policy import Mode, RetentionPolicy
from ._save_policy import SavePolicy

V = TypeVar("V")


@dataclasses.dataclass(frozen=True)
class ManagerOptions:
    """Every option of a `CheckpointManager`, checked. The shorthands are kept as given
    (after defaults) so that the manager's attributes read as before; the policies are
    what the manager uses."""

    prefix: str
    retention: RetentionPolicy
    save_policy: SavePolicy
    best_metric: str | None  # what "best" means for `best_step` and `restore(step="best")`
    mode: Mode
    keep_latest: int | None
    keep_best: int | None
    keep_every_n_steps: int | float | None
    save_interval_steps: int | None
    save_interval_seconds: int | float | None
    async_save: bool
    snapshot: Literal["device", "host", "auto"]  # a `_snapshot.SnapshotMode`
    host_window_bytes: int
    timeout_s: int | float
    handle_sigterm: bool
    replica_parallel: bool
    storage_options: Mapping[str, Any] | None
    # The local tier (see `_tiers`): None for none, and then the three below are unused.
    local_directory: str | None = None
    local_interval_steps: int | None = None
    local_keep_latest: int = 1
    peer_replicas: int = 1


class Option(Generic[V]):
    """A read-only attribute of a manager: its option of that name, as checked."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, manager: Any, owner: type | None = None) -> V:
        return getattr(manager._options, self.name)

    def __set__(self, manager: Any, value: V) -> None:
        raise AttributeError(
            f"CheckpointManager.{self.name} is read-only: it was checked at construction; "
            "make a new manager to change it."
        )
