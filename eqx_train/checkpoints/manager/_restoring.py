"""The restoring half of `CheckpointManager`: `restore` of the latest checkpoint (the
local tiers first, then the newest persistent one that verifies), of a step, or of the
best. The manager inherits it."""

from __future__ import annotations

import time
from typing import Any, Literal, TypeVar, overload

from ..._calls import calling
from ..._progress import Progress, reporting
from ..format import _names
from ..pipeline import _directory, _matching, _restore, _transform
from ..pipeline._options import RestoreOptions
from ..pipeline._restore import RESTORE_ATTEMPTS
from ._checks import restore_options
from ._fallback import restore_latest_that_verifies
from ._retention import Ranking
from ._tiers import Tiers

T = TypeVar("T")


class Restoring(Tiers):
    """`CheckpointManager.restore` and the ways it finds what to restore; set up by the
    manager's constructor, which also restores one checkpoint (`_restore_entry`)."""

    directory: str
    _store: Any
    _options: Any
    _ranking: Ranking
    _schedule: Any

    def wait(self) -> None:
        raise NotImplementedError

    def _restore_entry(self, entry: _directory.Entry, target: T, options: RestoreOptions) -> T:
        raise NotImplementedError

    @overload
    def restore(
        self,
        target: None,
        step: _names.Step | Literal["best"] | None = None,
        *,
        fallback: bool = True,
        config: Literal["target", "saved"] = "target",
        filter_spec: Any = None,
        strict: bool = True,
        rename: _matching.Rename = None,
        casting: _matching.Casting = "no",
        transform: _transform.Transform = None,
        progress: Progress = None,
    ) -> Any: ...

    @overload
    def restore(
        self,
        target: T,
        step: _names.Step | Literal["best"] | None = None,
        *,
        fallback: bool = True,
        config: Literal["target", "saved"] = "target",
        filter_spec: Any = None,
        strict: bool = True,
        rename: _matching.Rename = None,
        casting: _matching.Casting = "no",
        transform: _transform.Transform = None,
        progress: Progress = None,
    ) -> T: ...

    def restore(
        self,
        target: T,
        step: _names.Step | Literal["best"] | None = None,
        *,
        fallback: bool = True,
        config: Literal["target", "saved"] = "target",
        filter_spec: Any = None,
        strict: bool = True,
        rename: _matching.Rename = None,
        casting: _matching.Casting = "no",
        transform: _transform.Transform = None,
        progress: Progress = None,
    ) -> T:
        """Restores a checkpoint into the structure of `target`, as `restore_checkpoint`
        does.

        **Arguments:**

        - `target`: the pytree to fill (see `restore_checkpoint`), or None for the saved
          tree as nested dicts of arrays.
        - `step`: `None` for the latest checkpoint, `"best"` for the best by
          `best_metric`, or a step number.
        - `fallback`: only for `step=None`: if the latest checkpoint is corrupt (truncated,
          a failed checksum, a missing piece: `CheckpointFormatError`), restore the newest
          older one that reads and verifies instead, with an `UnreadableCheckpointWarning`
          naming each checkpoint skipped. A disk read error (`OSError`) of a local file
          counts as corruption. Each one skipped is moved aside, beside the others, to
          `corrupt-<its name>` (never deleted: inspect it, then delete it), so that it
          neither blocks saving its step again nor makes `should_save` take that step as
          saved. `False` raises the error instead. A checkpoint
          that reads fine but does not match `target` is never skipped (that is an error
          in the target), and a requested step or `"best"` never falls back.
        - `config`, `filter_spec`: as for `restore_checkpoint` (the target's Python
          configuration wins by default; `filter_spec` restores a part of the tree).
        - `strict`, `rename`, `casting`, `transform`: as for `restore_checkpoint`, for a
          model that changed since the save (see `plan_restore`); the fallback works with
          them too.
        - `progress`: as for `restore_checkpoint` (`True`: a tqdm bar on stderr; or a
          function `(done_bytes, total_bytes)`); one report for the whole call, however
          many checkpoints a fallback tries.

        **Returns:**

        The restored pytree; `target` unchanged when there is no checkpoint and
        `step=None`.

        **Raises:**

        `StepNotFoundError` (a `ValueError` and a `FileNotFoundError`) when `step` is
        missing or `"best"` finds no checkpoint with a usable metric; `ValueError` when
        the checkpoint does not match `target`;
        `CheckpointFormatError` when the checkpoint asked for is corrupt (with `fallback`:
        when every checkpoint is).

        A checkpoint removed by a concurrent save's retention while it was being chosen or
        read (the trainer saving while an evaluator restores) is chosen again from a fresh
        listing.

        In a multi-process job, call it on every process: the processes agree on which
        checkpoint to fall back to, so a corruption only one process reads makes all of
        them skip it.
        """
        with calling("CheckpointManager.restore"):
            options = restore_options(
                self._options,
                target,
                config=config,
                filter_spec=filter_spec,
                strict=strict,
                rename=rename,
                casting=casting,
                transform=transform,
                progress=progress,
            )
            self.wait()
            began = time.perf_counter()
            plain = target is not None and all(o is None for o in (filter_spec, rename, transform))
            if step is None and fallback and plain:
                found, tree = self._restore_local(target, began)
                if found:
                    return tree
            self._restored = None
            # One report for the whole call: a fallback's several restores share it.
            with reporting(progress, "restore"):
                if step == "best":
                    tree = self._restore_best(target, options)
                elif step is not None or not fallback:
                    tree = self._restore_step(target, step, options)
                else:
                    tree = self._restore_latest(target, options)
            self._last_restore = self._persistent_report(tree, target, step, began)
            return tree

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
            attempts=RESTORE_ATTEMPTS,
        )
        self._schedule.latest_known = False  # one skipped was moved aside: list again
        if restored is target:
            self._restored = None
            # No checkpoint of its own (a fine-tune's first run): other weights in the
            # directory (a Hugging Face layout) are read, or refused by name, never skipped.
            return self._restore_step(target, None, options)
        return restored

    def _restore_best(self, target: T, options: RestoreOptions) -> T:
        return self._ranking.restore_best(
            self._listing,
            lambda entry: self._restore_entry(entry, target, options),
            directory=self.directory,
            metric=self._options.best_metric,
            mode=self._options.mode,
            attempts=RESTORE_ATTEMPTS,
        )
