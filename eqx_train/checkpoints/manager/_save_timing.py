"""When a `CheckpointManager` saves: `should_save`, which asks the manager's save policy on
process 0 and gives every process its answer, and `preempted`. The manager inherits them."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import jax

from ..._calls import calling
from ..format import _names
from ..pipeline import _coordination
from . import _preemption


class SaveTiming:
    """The save-timing half of `CheckpointManager` (its `should_save` and `preempted`)."""

    _schedule: _preemption.SaveSchedule
    _options: Any
    _local: Any  # the local tier (`_tiers.LocalTier`), or None
    _due: tuple[Any, bool, bool] | None  # the last answer: (step, persistent, local)

    def _now(self) -> float:
        raise NotImplementedError

    def _latest(self) -> Decimal | None:
        raise NotImplementedError

    def should_save(self, step: _names.Step) -> bool:
        """Whether to save at `step`: True when `step` is newer than every checkpoint
        already in the directory or saved through this manager, and the save policy says
        so. The default policy says so when one of these holds:

        - `step` is a multiple of `save_interval_steps`;
        - `save_interval_seconds` have passed since the last save through this manager
          began (or since the manager was created);
        - a preemption was signalled: SIGTERM since the first `should_save` call (single
          process, `handle_sigterm=True`), or JAX's preemption sync point at this step
          (multi-process). From then on `preempted` is True (whatever the policy).

        With a `local_directory`, it also says True when `step` is a multiple of
        `local_interval_steps` (and newer than the last local save), and the next `save`
        of this step then writes the local tier alone, unless the persistent tier is due
        too.

        With neither interval set, only a preemption makes it True. It never saves by
        itself: call `save` when it says so, then leave the loop if `preempted`.

        **Arguments:**

        - `step`: the current step (int or float; JAX's sync point is consulted at integral
          steps only, so multi-process jobs should count in ints).

        **Returns:** `True` if this step should be saved.

        Call it once per step, with increasing steps, on every process of a multi-process
        job (JAX's sync point must be reached by all of them). Process 0 takes the decision
        with its own clock and its view of the directory, and every process receives the
        same answer, so hosts with skewed clocks never disagree on whether to save (this
        costs one key-value exchange per call on a multi-process job).

        **Example:**

        ```python
        import tempfile

        import numpy as np
        from eqx_train.checkpoints import CheckpointManager

        saved = []
        with CheckpointManager(tempfile.mkdtemp(), keep_latest=5, save_interval_steps=3) as mgr:
            for step in range(8):
                state = {"step": np.asarray(step)}  # one training step
                if mgr.should_save(step):
                    mgr.save(step, state)
                    saved.append(step)
                if mgr.preempted:
                    break
        assert saved == [0, 3, 6]
        ```

        **Differences from orbax:** orbax's `save` skips the step unless `should_save`
        agrees or `force=True`; here `save` always saves and the loop asks `should_save`.
        Orbax saves every step by default (`save_interval_steps=1`); here a manager with no
        interval saves only on preemption. Orbax also says yes at the first step of a run
        whose directory has no checkpoint; here a loop that starts at step 0 gets that from
        the step interval (0 is a multiple of every interval), and a time-only policy first
        saves one interval after the manager was created.
        """
        with calling("CheckpointManager.should_save"):
            value = _names.check_step(step)
            self._schedule.listen(multiprocess=jax.process_count() > 1)
            # Every process must reach JAX's sync point at every step, so each asks it
            # here, before process 0 decides; the answer is the same on every process.
            at_sync_point = value == value.to_integral_value() and (
                _coordination.reached_preemption(int(value))
            )
            decision = _coordination.decide(
                _coordination.next_id("should_save"),
                lambda: _preemption.DECISIONS[
                    self._schedule.decide(
                        value, at_sync_point=at_sync_point, now=self._now(), latest=self._latest
                    )
                ],
                timeout_s=self._options.timeout_s,
            )
        save, preempted = _preemption.DECISION_OF[str(decision)]
        self._schedule.preempted = self._schedule.preempted or preempted
        if self._local is None:
            return save
        local = self._local.due(value)
        self._due = (value, save, local)
        return save or local

    @property
    def preempted(self) -> bool:
        """True once `should_save` has seen a preemption (SIGTERM, or JAX's preemption sync
        point); it then stays True. The loop should save when `should_save` says so and
        then stop, so that the job exits cleanly and the next run resumes from that step.

        It turns True only inside `should_save`, never in between, so a loop that checks it
        right after `should_save` cannot leave without the save it was told to make."""
        return self._schedule.preempted
