"""`CheckpointManager`: saves into one directory, keeps what its retention policy keeps,
says when to save by its save policy (every N steps, every T seconds, on preemption),
raises the errors of background saves loudly."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

import jax
from jax.typing import ArrayLike

from ..._calls import calling, in_context
from ..._progress import Progress
from ..format import _names
from ..pipeline import _directory, _restore
from ..pipeline._async import AsyncManager
from ..pipeline._options import RestoreOptions, SaveOptions
from ..pipeline._restore import (
    RESTORE_ATTEMPTS,
    restore_one as restore_entry,  # tests wrap it here
)
from ..pipeline._save import save as save_pipeline  # tests wrap it here
from ..pipeline._snapshot import SnapshotMode
from ..pipeline._window import DEFAULT_HOST_WINDOW_BYTES
from ..storage import _locations
from . import _preemption, _retention
from ._checks import manager_options
from ._fallback import restore_latest_that_verifies
from ._restoring import Restoring
from ._retention import ManagedDirectory
from ._retention_policy import RetentionPolicy
from ._save_policy import SavePolicy
from ._save_timing import SaveTiming
from ._tiers import HOST_STATE_KEY, LastRestore, LocalTier, Tiers, encode_host_states

T = TypeVar("T")

# The clock of the time-based save policy; a module attribute so that tests can swap in a
# fake one. Monotonic, so that a wall-clock jump (NTP, a VM resumed) never forces or skips
# a save.
_clock = time.monotonic


class CheckpointManager(ManagedDirectory, SaveTiming, Tiers, Restoring):
    """Saves checkpoints into one directory and decides which to keep.

    Which checkpoints to keep is a retention policy, applied after each save is durable;
    when to save (`should_save`) is a save policy. Both are small objects that compose
    (see [Checkpointing recipes](../checkpointing_recipes.md#retention-and-save-policies)),
    given as `retention=` and `save_policy=`, or described by the shorthands below. By
    default (or with the shorthands) retention is the union of three rules:

    - the newest `keep_latest` checkpoints are always kept, so resuming always works
      (`KeepLatest`);
    - the best `keep_best` by `metrics[best_metric]` (lowest for `mode="min"`, highest for
      `"max"`; a NaN or missing metric never counts; ties go to the newer step)
      (`KeepBest`);
    - flax's `keep_every_n_steps` rule over the checkpoints older than the newest
      `keep_latest` (`KeepEveryNSteps`).

    Whatever the policy, the checkpoint a save just wrote is never deleted by it.

    Metrics and a user `metadata` dict live inside each checkpoint file (its safetensors
    metadata), so the directory has no side files to lose or get out of sync, and a new
    manager on an existing directory sees every checkpoint and its metrics.

    **Arguments:**

    - `directory`: where the checkpoints go (created if missing): a local path or an
      object-store URL (`s3://bucket/run`, `gs://bucket/run`, `memory://run`).
    - `retention`: a retention policy (`KeepLatest`, `KeepBest`, `KeepEveryNSteps`,
      `KeepAny`, or your own object with a `keep(context)` method); `None` for the one
      the shorthands describe. Refused together with `keep_latest`, `keep_best` or
      `keep_every_n_steps`.
    - `keep_latest`: newest checkpoints to keep (>= 1; `None`: 1). Shorthand for
      `KeepLatest(keep_latest)`.
    - `keep_best`: best checkpoints to keep by `best_metric` (`None` or 0 for none).
      Shorthand for `KeepBest(keep_best, best_metric, mode)`.
    - `best_metric`: the name of the metric that ranks checkpoints; required if
      `keep_best > 0` or to `restore(..., step="best")`. With `retention=`, `None` takes
      the metric and mode of the policy's `KeepBest` members, if they rank by one.
    - `mode`: `"min"` or `"max"`.
    - `keep_every_n_steps`: see above; `None` for none. Shorthand for
      `KeepEveryNSteps(keep_every_n_steps)`.
    - `save_policy`: when `should_save` says yes: a save policy (`SaveEveryNSteps`,
      `SaveEveryNSeconds`, `SaveOnPreemption`, `SaveAny`, or your own object with a
      `should_save(context)` method); `None` for the one the shorthands describe (on a
      preemption, and at the intervals given). Refused together with
      `save_interval_steps` or `save_interval_seconds`.
    - `prefix`: file name prefix, as for `save_checkpoint`.
    - `async_save`: write in a background thread (one save in flight). The state is
      snapshotted at `save`; an error in the background is raised by the next `save`,
      `wait` or `close` (or when leaving a `with` block).
    - `snapshot`: how an async save snapshots the array leaves: `"device"`, `"host"` or
      `"auto"` (default), as for `save_checkpoint`.
    - `host_window_bytes`: the most leaf bytes a save or a restore holds on the host at
      once (at least one leaf), as for `save_checkpoint` and `restore_checkpoint`.
    - `timeout_s`: in a multi-process job, how long to wait for the other processes.
    - `save_interval_steps`: `should_save(step)` says yes when `step` is a multiple of
      this (an int >= 1); `None` for no step interval. Shorthand for
      `SaveAny(SaveOnPreemption(), SaveEveryNSteps(save_interval_steps))`.
    - `save_interval_seconds`: `should_save` says yes once this many seconds (a finite
      number > 0) have passed since the last save through this manager began, or since
      the manager was created; `None` for no time interval. Shorthand for
      `SaveEveryNSeconds(save_interval_seconds)`, with `SaveOnPreemption()`.
    - `replica_parallel`: in a multi-process job, split the writing of replicated blocks
      between the processes holding them and read them once across the job on restore
      (default), as `save_checkpoint_multiprocess` and `restore_checkpoint` do with it;
      `False` for the layout and reads of before (for stores where it measures worse).
    - `handle_sigterm`: let SIGTERM mark a preemption (see below); `False` leaves signal
      handling alone.
    - `storage_options`: for an object-store URL, options of its fsspec filesystem
      (credentials, `client_kwargs={"endpoint_url": ...}`); the standard environment
      variables apply too.
    - `local_directory`: this process's own fast storage (a local disk or RAM disk, never
      shared) for a local tier beside `directory`, saved every `local_interval_steps`
      (`None`: at the persistent tier's saves only), keeping its newest
      `local_keep_latest` steps; each process's part is also kept by `peer_replicas`
      other processes. `restore` then takes the newest step complete across the tiers.
      See [Checkpoint tiers](../checkpoint_tiers.md).

    On creation the manager removes temporary files left by a killed save of this
    directory and prefix (only files named as this library names them, and only if the
    process that wrote them is gone).

    **Example:**

    ```python
    import tempfile

    import numpy as np
    from eqx_train.checkpoints import CheckpointManager

    state = {"w": np.zeros(3, np.float32)}
    directory = tempfile.mkdtemp()
    with CheckpointManager(directory, keep_latest=2, keep_best=1, best_metric="val_loss") as mgr:
        for epoch, val_loss in enumerate([0.9, 0.3, 0.5, 0.4]):
            state = {"w": state["w"] + 1}
            mgr.save(epoch, state, metrics={"val_loss": val_loss}, metadata={"lr": 1e-3})
    assert mgr.all_steps() == [1, 2, 3]  # the best (1) and the latest two
    best = mgr.restore(state, step="best")
    assert best["w"].tolist() == [2.0, 2.0, 2.0]
    ```

    **Multi-process jobs:** create the manager and call `save` on every process of a
    `jax.distributed` job with the same arguments; it then saves with
    `save_checkpoint_multiprocess` (each process writes its own shards, `timeout_s` bounds
    the waits) and process 0 applies the retention policy. Reading methods work on every
    process.

    **When to save:** `save` always saves. To save on a schedule, call it when
    `should_save(step)` says so; see `should_save` for the rules (intervals, preemption,
    never a step already saved) and the loop that resumes after a preemption.

    **Preemption:** with `handle_sigterm=True` (the default), the first `should_save` call
    made on the main thread of a single-process job registers the manager with the
    library's SIGTERM handler, which only records the signal (and calls the handler that
    was there before, if a Python function); the next `should_save` answers yes, the loop
    saves, sees `preempted` and exits cleanly. `close()` unregisters the manager; the last
    one closed puts the previous handler back. A manager whose `should_save` is never
    called never touches signals. In a multi-process job JAX's preemption service listens
    instead, and `should_save` consults its sync point. See
    [Cloud storage and preemption](../cloud_storage.md#preemption).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        retention: RetentionPolicy | None = None,
        keep_latest: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        mode: Literal["min", "max"] = "min",
        keep_every_n_steps: int | float | None = None,
        prefix: str = "checkpoint_",
        async_save: bool = False,
        snapshot: SnapshotMode = "auto",
        host_window_bytes: int = DEFAULT_HOST_WINDOW_BYTES,
        timeout_s: int | float = 300.0,
        save_policy: SavePolicy | None = None,
        save_interval_steps: int | None = None,
        save_interval_seconds: int | float | None = None,
        handle_sigterm: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        replica_parallel: bool = True,
        local_directory: str | os.PathLike[str] | None = None,
        local_interval_steps: int | None = None,
        local_keep_latest: int = 1,
        peer_replicas: int = 1,
    ):
        with calling("CheckpointManager"):
            # Every keyword argument, checked once into one frozen object.
            given = {k: v for k, v in locals().items() if k not in ("self", "directory")}
            options = manager_options(**given)
            self._options = options
            self._attempts = RESTORE_ATTEMPTS
            self._store, self.directory = _locations.resolve(directory, storage_options)
            self._async = AsyncManager() if async_save else None
            self._store.makedirs(self.directory)
            _directory.remove_leftovers(self._store, self.directory, options.prefix)
        self._schedule = _preemption.SaveSchedule(
            options.save_policy, handle_sigterm=options.handle_sigterm, now=_clock()
        )
        self._ranking = _retention.Ranking(self._store)
        self._last_restore: LastRestore | None = None
        self._restored: _directory.Entry | None = None  # the persistent step last restored
        self._due: tuple[Any, bool, bool] | None = None  # should_save's (step, persistent, local)
        with calling("CheckpointManager"):
            self._local = LocalTier.of(options)

    # ------------------------------------------------------------------ saving

    def save(
        self,
        step: _names.Step,
        state: Any,
        *,
        metrics: Mapping[str, ArrayLike] | None = None,
        metadata: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        filter_spec: Any = None,
        host_state: Any = None,
        progress: Progress = None,
    ) -> str:
        """Saves `state` at `step` with its metrics and metadata; returns the file's path.

        **Arguments:**

        - `step`: int or float, newer than the latest checkpoint unless `overwrite=True`
          (which replaces that step and deletes every newer one, as flax does).
        - `state`: any pytree (e.g. `(train_state, early_stopping)`).
        - `metrics`: name -> number, stored in the file; used by `best_metric`.
        - `metadata`: any JSON-serialisable dict (hyperparameters, model config, git
          revision), stored in the file.
        - `filter_spec`: save only the leaves it selects, as for `save_checkpoint`
          (`eqx.is_array`: the arrays, no Python configuration).
        - `host_state`: this process's own JSON-serialisable value (a data iterator's
          position, a NumPy generator's state), saved atomically with the step in every
          tier and given back by the restore as `last_restore.host_state`. In a
          multi-process job each process passes its own (on every process, or on none).
        - `progress`: as for `save_checkpoint` (`True`: a tqdm bar on stderr; or a function
          `(done_bytes, total_bytes)`, called from the thread that writes), for the
          persistent tier's write.

        With a `local_directory`, it writes the tiers `should_save(step)` found due (both
        when it was not asked), and returns the local directory when only the local was.

        Raises the error of a failed previous background save, if any, and
        `StepExistsError` (a `ValueError` and a `FileExistsError`) when `step` is not newer
        than the latest checkpoint and `overwrite` is False.
        """
        began = _clock()
        options = self._options
        host_states = None

        def extra() -> dict[str, str]:
            # Encoded inside the save, so that a bad value on one process of a multi-process
            # job fails the save on all of them.
            hosts = None if host_states is None else {HOST_STATE_KEY: host_states}
            return _retention.file_metadata(metrics, metadata, hosts)

        with calling("CheckpointManager.save"):
            persistent, local = self._tiers_due(step)
            if local and self._local is not None:
                self._local.save(step, state, host_state)
                if not persistent:
                    return self._local.directory
            if host_state is not None:
                host_states = encode_host_states(host_state, timeout_s=options.timeout_s)
            path = save_pipeline(
                self.directory,
                state,
                step,
                options=SaveOptions(
                    prefix=options.prefix,
                    overwrite=overwrite,
                    # Run after the commit, on the background thread of an async save.
                    retention=in_context(self._to_delete),
                    extra_metadata=extra,
                    multiprocess=jax.process_count() > 1,
                    timeout_s=options.timeout_s,
                    snapshot=options.snapshot,
                    host_window_bytes=options.host_window_bytes,
                    filter_spec=filter_spec,
                    progress=progress,
                    replica_parallel=options.replica_parallel,
                ),
                storage_options=options.storage_options,
                async_manager=self._async,
            )
            self._schedule.saved(_names.check_step(step), began)
        return path

    def wait(self) -> None:
        """Blocks until the background save (if any) is done; raises its error if it failed."""
        if self._async is not None:
            self._async.wait_previous_save()
        if self._local is not None:
            self._local.wait()

    def close(self) -> None:
        """Waits for the background save and raises its error, if any, then puts back the
        SIGTERM handler that this manager replaced (if it installed one)."""
        try:
            self.wait()
        finally:
            self._schedule.stop_listening()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as save_error:  # report both, without hiding the original error
            exc.add_note(f"Also, a background checkpoint save failed: {save_error!r}")

    # ------------------------------------------------------------------ internals

    def _restore_step(self, target: T, step: Any, options: RestoreOptions) -> T:
        """The checkpoint of `step` (None: the latest) restored, as `restore_checkpoint`
        restores it from the manager's directory."""
        return _restore.restore(
            self._store, self.directory, target, step, self._options.prefix, options
        )

    def _restore_latest(self, target: T, options: RestoreOptions) -> T:
        """The newest checkpoint that verifies restored; the others skipped, moved aside."""
        restored = restore_latest_that_verifies(
            self._store,
            self.directory,
            self._listing,
            lambda entry: self._restore_entry(entry, target, options),
            target,
            timeout_s=self._options.timeout_s,
            attempts=self._attempts,
        )
        self._schedule.latest_known = False  # one skipped was moved aside: list again
        if restored is target:
            self._restored = None
            # No checkpoint of its own (a fine-tune's first run): other weights in the
            # directory (a Hugging Face layout) are read, or refused by name, never skipped.
            return self._restore_step(target, None, options)
        return restored

    def _restore_entry(self, entry: _directory.Entry, target: T, options: RestoreOptions) -> T:
        restored = restore_entry(self._store, entry, target, options)
        self._restored = entry  # the one restored: its step and host state for last_restore
        return restored

    def _header(self, entry: _directory.Entry) -> dict[str, str]:
        return _retention.metadata_of(self._store, entry)

    def _now(self) -> float:
        return _clock()  # read here, so that tests can swap the module's clock

    def _to_delete(self, entries: list[_directory.Entry]) -> list[str]:
        return _retention.to_delete(entries, self._options.retention, self._ranking)
