"""When a `CheckpointManager` saves because the job is ending: the answers `should_save`
shares between processes, and the library's one SIGTERM handler with its registry of live
managers (each told by setting its `_sigterm_received`)."""

from __future__ import annotations

import signal
import weakref
from typing import Any

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
                manager._sigterm_received = True
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
