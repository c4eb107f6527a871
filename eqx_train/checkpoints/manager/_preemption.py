"""When a `CheckpointManager` saves: its `SaveSchedule` (what its save policy is told),
the answers `should_save` shares between processes, and the library's one SIGTERM handler
with its registry of live schedules (each told by setting its `sigterm_received`)."""

from __future__ import annotations

import signal
import threading
import weakref
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from ._save_policy import SaveContext, SavePolicy

# `should_save`'s answer as process 0 shares it: (save this step, preemption seen).
DECISIONS = {
    (False, False): "skip",
    (True, False): "save",
    (False, True): "preempted, already saved",
    (True, True): "preempted, save",
}
DECISION_OF = {text: pair for pair, text in DECISIONS.items()}


class SigtermListeners:
    """The library's one SIGTERM handler and the live managers it tells.

    The handler is installed when the first manager registers and put back (the handler
    that was there before it) when the last one unregisters, so managers may be closed in
    any order: a closed manager is never told again, and SIGTERM keeps its usual meaning
    once none is live. Main thread only (Python sets and runs handlers there)."""

    def __init__(self) -> None:
        # Weak: a manager dropped without `close()` stops listening once it is collected.
        self.managers: weakref.WeakSet[Any] = weakref.WeakSet()
        self.previous: Any = None
        self.running = False

    def handle(self, signum: int, frame: Any) -> None:
        if self.running:  # a handler installed over ours that chains back to us
            return
        self.running = True
        try:
            for manager in list(self.managers):
                manager.sigterm_received = True
            previous = self.previous
            if callable(previous):  # a Python handler; never SIG_DFL, which would kill us
                previous(signum, frame)
        finally:
            self.running = False

    def register(self, manager: Any) -> None:
        if signal.getsignal(signal.SIGTERM) != self.handle:
            # First listener, or someone replaced our handler since: (re)install, chaining
            # to whatever is there now.
            self.previous = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self.handle)
        self.managers.add(manager)

    def unregister(self, manager: Any) -> None:
        self.managers.discard(manager)
        if len(self.managers) or signal.getsignal(signal.SIGTERM) != self.handle:
            # Others still listen; or a handler was installed over ours and stays (it may
            # chain to ours, which then only chains on).
            return
        previous = self.previous
        # None: the previous handler was not set from Python; the default is the closest
        # we can put back.
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        self.previous = None


SIGTERM = SigtermListeners()


class SaveSchedule:
    """What one manager's `should_save` knows between calls: when its last save began, the
    newest step saved, whether a preemption was seen. Only process 0's copy decides."""

    def __init__(self, policy: SavePolicy, *, handle_sigterm: bool, now: float):
        self.policy = policy
        self.handle_sigterm = handle_sigterm
        self.last_save_began = now
        self.latest_saved: Decimal | None = None  # read from the directory on first use
        self.latest_known = False
        self.sigterm_received = False
        self.preempted = False
        self.listens = False  # registered with the library's SIGTERM handler

    def saved(self, value: Decimal, began: float) -> None:
        """A save of step `value`, begun at `began`, succeeded: it is the newest (an older
        step needs overwrite=True, which deletes the newer ones)."""
        self.latest_saved, self.latest_known, self.last_save_began = value, True, began

    def decide(
        self,
        value: Decimal,
        *,
        at_sync_point: bool,
        now: float,
        latest: Callable[[], Decimal | None],
    ) -> tuple[bool, bool]:
        """(save step `value`, preemption seen), by this process's clock (`now`) and the
        newest step in the directory (`latest()`, asked once until a fallback moves one
        aside)."""
        preempted = self.preempted or self.sigterm_received or at_sync_point
        if not self.latest_known:
            self.latest_saved, self.latest_known = latest(), True
        if self.latest_saved is not None and value <= self.latest_saved:
            return False, preempted  # never a step already saved, whatever the policy
        context = SaveContext(value, float(now - self.last_save_began), preempted)
        return bool(self.policy.should_save(context)), preempted

    def listen(self, *, multiprocess: bool) -> None:
        """Registers with the library's SIGTERM handler, if this schedule may."""
        if (
            not self.handle_sigterm
            or self.listens
            # Multi-process: JAX's preemption notifier owns SIGTERM (replacing its handler
            # would hide preemptions from the sync point).
            or multiprocess
            # Python runs signal handlers, and lets them be set, on the main thread only.
            or threading.current_thread() is not threading.main_thread()
        ):
            return
        SIGTERM.register(self)
        self.listens = True

    def stop_listening(self) -> None:
        """Unregisters from the library's SIGTERM handler (main thread only)."""
        if self.listens and threading.current_thread() is threading.main_thread():
            SIGTERM.unregister(self)
            self.listens = False
