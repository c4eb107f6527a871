"""A `CheckpointManager`'s keyword arguments, checked once at construction into the
frozen `ManagerOptions` that the manager takes whole (the retention and save shorthands,
`keep_latest`, `save_interval_steps`..., become policies here), and the keyword arguments
of its `restore`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..._progress import Progress
from ..format import _names
from ..pipeline._options import Casting, RestoreOptions, check_snapshot
from ..pipeline._rename import Rename
from ..pipeline._transform import Transform
from ._options import ManagerOptions
from ._retention_policy import (
    KeepAny,
    KeepBest,
    KeepEveryNSteps,
    KeepLatest,
    RetentionPolicy,
    best_of,
    check_mode,
)
from ._save_policy import (
    SaveAny,
    SaveEveryNSeconds,
    SaveEveryNSteps,
    SaveOnPreemption,
    SavePolicy,
    check_seconds,
    check_steps,
)

_WHO = "CheckpointManager"


def manager_options(**given: Any) -> ManagerOptions:
    """The checked options of `CheckpointManager(directory, **given)` (every keyword but
    the directory). Raises `ValueError` (or `TypeError` for a policy that is not one)
    naming the first invalid keyword, or two that say the same thing."""
    retention, keep_latest, keep_best = _retention_of(given)
    best_metric, mode = given["best_metric"], given["mode"]
    if best_metric is None and given["retention"] is not None:
        # "best" for `restore(step="best")`: the metric the policy ranks by, if just one.
        best_metric, mode = best_of(retention) or (None, mode)
    prefix = given["prefix"]
    if not prefix:
        raise ValueError(f"{_WHO}: prefix must be a non-empty file name prefix.")
    _names.check_prefix(prefix)
    timeout_s = given["timeout_s"]
    if not isinstance(timeout_s, int | float) or not timeout_s > 0:
        raise ValueError(f"{_WHO}: timeout_s must be > 0, got {timeout_s!r}.")
    save_policy = _save_policy_of(given)
    check_snapshot(given["snapshot"], given["host_window_bytes"])
    for flag in ("handle_sigterm", "replica_parallel"):
        if not isinstance(given[flag], bool):
            raise ValueError(f"{_WHO}: {flag} must be True or False, got {given[flag]!r}.")
    return ManagerOptions(
        prefix=prefix,
        retention=retention,
        save_policy=save_policy,
        best_metric=best_metric,
        mode=mode,
        keep_latest=keep_latest,
        keep_best=keep_best,
        keep_every_n_steps=given["keep_every_n_steps"],
        save_interval_steps=given["save_interval_steps"],
        save_interval_seconds=given["save_interval_seconds"],
        async_save=given["async_save"],
        snapshot=given["snapshot"],
        host_window_bytes=given["host_window_bytes"],
        timeout_s=timeout_s,
        handle_sigterm=given["handle_sigterm"],
        replica_parallel=given["replica_parallel"],
        storage_options=given["storage_options"],
        **_local_tier_of(given),
    )


def _local_tier_of(given: Mapping[str, Any]) -> dict[str, Any]:
    """The local tier's options: `local_directory` (a path or None), its interval, its
    retention and the peer copies."""
    directory, interval = given["local_directory"], given["local_interval_steps"]
    keep, replicas = given["local_keep_latest"], given["peer_replicas"]
    if directory is not None and not isinstance(directory, str | os.PathLike):
        raise ValueError(
            f"{_WHO}: local_directory must be a path (this process's own disk or RAM disk) "
            f"or None, got {directory!r}."
        )
    if directory is None and interval is not None:
        raise ValueError(
            f"{_WHO}: local_interval_steps={interval!r} needs local_directory, the local "
            "tier it schedules."
        )
    if interval is not None:
        check_steps(interval, f"{_WHO}: local_interval_steps", " or None")
    for name, value, least in (("local_keep_latest", keep, 1), ("peer_replicas", replicas, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{_WHO}: {name} must be an int >= {least}, got {value!r}.")
    return {
        "local_directory": None if directory is None else os.fspath(directory),
        "local_interval_steps": interval,
        "local_keep_latest": keep,
        "peer_replicas": replicas,
    }


def _refuse_both(policy: str, given: Mapping[str, Any], shorthands: tuple[str, ...]) -> None:
    both = [name for name in shorthands if given[name] is not None]
    if given[policy] is not None and both:
        raise ValueError(
            f"{_WHO}: {policy}= and {both[0]}= both say "
            + ("which checkpoints to keep" if policy == "retention" else "when to save")
            + f"; pass one of them (got {policy}={given[policy]!r}, {both[0]}="
            f"{given[both[0]]!r}). The policy can say it too: see the {policy} policies."
        )


def _retention_of(given: Mapping[str, Any]) -> tuple[RetentionPolicy, int | None, int | None]:
    """(the retention policy, keep_latest, keep_best): `retention=`, or the policy the
    shorthands describe (the newest `keep_latest`, flax's every-n-steps, the best
    `keep_best`)."""
    _refuse_both("retention", given, ("keep_latest", "keep_best", "keep_every_n_steps"))
    mode = given["mode"]
    policy = given["retention"]
    if policy is not None:
        check_mode(mode, f"{_WHO}: mode")
        if not isinstance(policy, RetentionPolicy):
            raise TypeError(
                f"{_WHO}: retention must be a retention policy (KeepLatest, KeepBest, "
                f"KeepEveryNSteps, KeepAny or an object with a keep(context) method), got "
                f"{policy!r}."
            )
        return policy, None, None
    keep_latest = 1 if given["keep_latest"] is None else given["keep_latest"]
    keep_best = 0 if given["keep_best"] is None else given["keep_best"]
    every, best_metric = given["keep_every_n_steps"], given["best_metric"]
    if isinstance(keep_latest, bool) or not isinstance(keep_latest, int) or keep_latest < 1:
        raise ValueError(
            f"{_WHO}: keep_latest must be an int >= 1 (the newest checkpoint is what "
            f"resuming needs), got {keep_latest!r}."
        )
    if isinstance(keep_best, bool) or not isinstance(keep_best, int) or keep_best < 0:
        raise ValueError(f"{_WHO}: keep_best must be an int >= 0, got {keep_best!r}.")
    if keep_best > 0 and not best_metric:
        raise ValueError(
            f"{_WHO}: keep_best={keep_best} needs best_metric, the name of the metric that "
            "ranks checkpoints (e.g. best_metric='val_loss')."
        )
    check_mode(mode, f"{_WHO}: mode")
    if every is not None and (
        isinstance(every, bool) or not isinstance(every, int | float) or not every > 0
    ):
        raise ValueError(
            f"{_WHO}: keep_every_n_steps must be a positive number or None, got {every!r}."
        )
    # In this order: the policies that read metrics last, so that `KeepAny` reads them only
    # when some checkpoint might go.
    members: list[RetentionPolicy] = [KeepLatest(keep_latest)]
    if every is not None:
        members.append(KeepEveryNSteps(every))
    if keep_best:
        members.append(KeepBest(keep_best, best_metric, mode))
    return (members[0] if len(members) == 1 else KeepAny(*members)), keep_latest, keep_best


def _save_policy_of(given: Mapping[str, Any]) -> SavePolicy:
    """`save_policy=`, or the policy the shorthands describe: on preemption, and at the
    step and time intervals given."""
    _refuse_both("save_policy", given, ("save_interval_steps", "save_interval_seconds"))
    policy = given["save_policy"]
    if policy is not None:
        if not isinstance(policy, SavePolicy):
            raise TypeError(
                f"{_WHO}: save_policy must be a save policy (SaveEveryNSteps, "
                "SaveEveryNSeconds, SaveOnPreemption, SaveAny or an object with a "
                f"should_save(context) method), got {policy!r}."
            )
        return policy
    steps, seconds = given["save_interval_steps"], given["save_interval_seconds"]
    members: list[SavePolicy] = [SaveOnPreemption()]
    if steps is not None:
        check_steps(steps, f"{_WHO}: save_interval_steps", " or None")
        members.append(SaveEveryNSteps(steps))
    if seconds is not None:
        check_seconds(seconds, f"{_WHO}: save_interval_seconds", " or None")
        members.append(SaveEveryNSeconds(seconds))
    return members[0] if len(members) == 1 else SaveAny(*members)


def restore_options(
    options: ManagerOptions,
    target: Any,
    *,
    config: Any,
    filter_spec: Any,
    strict: bool,
    rename: Rename,
    casting: Casting,
    transform: Transform,
    progress: Progress,
) -> RestoreOptions:
    """The checked options of a `CheckpointManager.restore` into `target`, with the
    manager's own, as the restore pipeline takes them (errors name the call in progress)."""
    return RestoreOptions(
        config=config,
        filter_spec=filter_spec,
        strict=strict,
        rename=rename,
        casting=casting,
        transform=transform,
        host_window_bytes=options.host_window_bytes,
        replica_parallel=options.replica_parallel,
        progress=progress,
    ).check(target)
