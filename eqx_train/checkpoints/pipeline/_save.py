"""The one save path, as stages: plan -> snapshot -> transfer -> write -> commit.

`save_checkpoint`, `save_checkpoint_multiprocess` and `CheckpointManager.save` differ only
in their `SaveOptions`: the layout (one file, or a `.shards` directory of per-process piece
files) and so the commit, and the retention applied once the commit is durable.

- **plan** (`_plan`): check the options, resolve the storage, describe the tree, check the
  step is newer; nothing is written or deleted before it has passed. In a multi-process
  save the processes then agree on what to save (`_multiprocess.agree_on_token`).
- **snapshot** (`_snapshot.snapshot`): an async save's values, out of reach of the
  caller's later changes to its buffers.
- **transfer** and **write** (`_transfer.host_arrays` feeding `_format.write_file`, set up
  by `_write_stage`): leaves move to the host a window at a time while earlier ones are
  hashed and written.
- **commit**: the atomic write of the file, or of the `.shards` index once every piece is
  durable (`_multiprocess.write_and_commit`); then retention.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jax
else:  # imported on first use: the command line reads headers without JAX
    from ..._lazy import LazyModule

    jax = LazyModule("jax")

from ..._calls import call, in_context
from ..._progress import reporting
from .._errors import StepExistsError
from ..format import _description, _format, _names
from ..storage import _locations
from ..storage._base import Storage
from . import _directory, _multiprocess, _selection, _snapshot, _transfer, _window
from ._async import AsyncManager
from ._options import SaveOptions


@dataclass
class Save:
    """What one save carries from stage to stage: where it goes and what it writes."""

    store: Storage
    directory: str
    value: Decimal  # the step, exactly
    step_text: str  # the step as its file name spells it
    final_path: str
    description: Any
    tensors: list[_description.Tensor]
    metadata: dict[str, str]


def save(
    ckpt_dir: str | os.PathLike[str],
    target: Any,
    step: _names.Step,
    options: SaveOptions,
    *,
    storage_options: Mapping[str, Any] | None = None,
    async_manager: AsyncManager | None = None,
) -> str:
    """Saves `target` at `step` in `ckpt_dir` as `options` say; returns the checkpoint's
    path (being written, with `async_manager`).

    Validates everything before touching the disk, writes, commits, then (after the commit
    is durable) removes newer steps when `options.overwrite` and the steps
    `options.retention` names. Errors name the public call in progress (`_errors.call`)."""
    # First, before anything can fail: the save's number, which keys its exchanges (a
    # process that fails below still takes part in the opening exchange, so the numbers
    # stay the same on every process).
    number = _multiprocess.begin_save() if options.multiprocess else None
    try:
        planned = _plan(ckpt_dir, target, step, options, storage_options, async_manager)
    except Exception as error:
        if number is not None:
            # Reported to the others in the opening exchange, which then raises it here.
            _multiprocess.agree_on_token(number, error, timeout_s=options.timeout_s)
        raise
    if number is None:
        _snapshot_stage(planned, options, async_manager)
        commit = _single_commit(planned, options)
    else:
        commit = _multiprocess_commit(planned, number, options, async_manager)
    task = in_context(lambda: _write_stage(planned, options, commit))
    if async_manager is not None:
        async_manager.save_async(task, (planned.directory, options.prefix), planned.value)
    else:
        task()
    return planned.final_path


def _plan(
    ckpt_dir: str | os.PathLike[str],
    target: Any,
    step: _names.Step,
    options: SaveOptions,
    storage_options: Mapping[str, Any] | None,
    async_manager: AsyncManager | None,
) -> Save:
    """The plan stage: every check, before anything is written or deleted."""
    options.check()
    store, where = _locations.resolve(ckpt_dir, storage_options)
    if options.multiprocess and store.stale_by_age and options.timeout_s > _directory.STALE_S / 2:
        # On an object store nobody can tell a live writer's uncommitted pieces from a
        # dead one's but by age: other saves remove them after `STALE_S`.
        raise ValueError(
            f"{call()}: timeout_s={options.timeout_s!r} is too long for an object store; at "
            f"most {_directory.STALE_S / 2:.0f} s, since uncommitted pieces older than "
            f"{_directory.STALE_S:.0f} s count as abandoned."
        )
    value = _names.check_step(step)
    try:
        name = _names.checkpoint_name(options.prefix, step, sharded=options.multiprocess)
    except ValueError as error:
        raise ValueError(f"{call()}: {error}") from None
    if async_manager is not None:
        # At most one save in flight (a multi-process save: none) from here on.
        async_manager.wait_until(0 if options.multiprocess else 1)
    store.start_deadline()  # every request of this save, from here on, shares one budget
    description, tensors = _description.describe(
        _selection.filtered_for_saving(target, options.filter_spec),
        allow_global=options.multiprocess,
    )
    step_text = _names.canonical_step(step)
    extra = options.extra_metadata
    extra = extra() if callable(extra) else extra
    metadata = {**_format.base_metadata(step_text, description), **(extra or {})}
    _format.check_header_size(tensors, metadata)
    if async_manager is not None and async_manager.in_flight():
        # Queued behind the save being written only where its snapshot fits next to
        # that save's; otherwise (and for a step that is not newer, or a save to an
        # object store, whose request budget has started) wait for it.
        if not (
            not store.save_deadline
            and async_manager.may_queue((where, options.prefix), value)
            and _snapshot.another_fits(tensors, options.snapshot)
        ):
            async_manager.wait_previous_save()
    store.makedirs(where)
    _directory.check_newer(store, where, options.prefix, value, step_text, options.overwrite)
    final_path = store.join(where, name)
    return Save(store, where, value, step_text, final_path, description, tensors, metadata)


def _snapshot_stage(
    planned: Save, options: SaveOptions, async_manager: AsyncManager | None
) -> None:
    """The snapshot stage: an async save's values, out of reach of the caller, who may
    mutate or donate its buffers as soon as the save returns."""
    if async_manager is not None:
        planned.tensors = _snapshot.snapshot(
            planned.tensors, options.snapshot, warn=_snapshot.warn_once_per(async_manager)
        )


def _write_stage(planned: Save, options: SaveOptions, commit: Callable[[], None]) -> None:
    """The transfer and write stages around `commit`: the writer takes its leaves through
    the transfer pipeline, within the save's host window; whatever the snapshot still
    holds is let go at the end, written or not."""
    try:
        with (
            _window.host_window_bytes(options.host_window_bytes),
            _format.leaves_from(_transfer.through_window),
            reporting(options.progress, "save"),
        ):
            commit()
    finally:
        _snapshot.release(planned.tensors)


def _retention_stage(planned: Save, options: SaveOptions) -> None:
    """After the commit is durable: newer steps go when overwriting, then what the
    retention names."""
    _directory.apply_retention(
        planned.store,
        planned.directory,
        options.prefix,
        planned.value,
        planned.final_path,
        overwrite=options.overwrite,
        retention=options.retention,
    )


def _single_commit(planned: Save, options: SaveOptions) -> Callable[[], None]:
    """The commit of one file: written under a temporary name and renamed into place (or
    uploaded under its final name), refusing a checkpoint of the step that a concurrent
    save committed meanwhile unless overwriting."""

    def commit() -> None:
        store = planned.store
        _directory.remove_leftovers(store, planned.directory, options.prefix)
        try:
            store.atomic_write(
                planned.final_path,
                lambda fd: _format.write_file(fd, planned.tensors, planned.metadata),
                replace=options.overwrite,
            )
        except FileExistsError:
            raise StepExistsError(
                f"{call()}: a checkpoint at step {planned.step_text} appeared in "
                f"{planned.directory} while this save was writing (a concurrent save); it was "
                "kept. Pass overwrite=True to replace it."
            ) from None
        _retention_stage(planned, options)

    return commit


def _multiprocess_commit(
    planned: Save, number: int, options: SaveOptions, async_manager: AsyncManager | None
) -> Callable[[], None]:
    """The processes agree on the save (the opening exchange), snapshot, plan their pieces;
    the commit then writes every process's piece and, once all are durable, process 0's
    index."""
    token = _multiprocess.agree_on_token(
        number,
        (planned.step_text, options.prefix, planned.description, planned.tensors),
        timeout_s=options.timeout_s,
    )
    key = _multiprocess.save_key(number, planned.step_text)
    pieces: Any
    try:
        _snapshot_stage(planned, options, async_manager)
        pieces = _multiprocess.plan_pieces(
            planned.tensors, jax.process_index(), replica_parallel=options.replica_parallel
        )
    except Exception as error:  # reported when the pieces are collected
        pieces = error

    def commit() -> None:
        mine = pieces
        if jax.process_index() == 0:
            try:
                _directory.remove_leftovers(
                    planned.store,
                    planned.directory,
                    options.prefix,
                    keep_token=token,
                    current=planned.final_path,
                )
            except Exception as error:  # reported with the pieces: all give up at once
                mine = error
        _multiprocess.write_and_commit(
            planned.store,
            planned.final_path,
            token,
            key,
            mine,
            planned.tensors,
            planned.metadata,
            timeout_s=options.timeout_s,
            overwrite=options.overwrite,
            after_commit=lambda: _retention_stage(planned, options),
        )

    return commit
