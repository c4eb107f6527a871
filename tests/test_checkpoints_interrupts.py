"""What an interrupt (Ctrl-C, or a `SystemExit` raised by a signal handler) does to a restore
and to an async save: a restore stops promptly and lets go of its host window; a save being
waited for stays tracked, so a later wait still waits for it and raises its error.

Each interrupt is delivered at a known point: from a hook at that point
(`_thread.interrupt_main()`), or as a real SIGINT once the main thread is seen blocked in
the wait.
"""

import _thread
import signal
import threading
import time
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints.format import _format
from eqx_train.checkpoints.pipeline import _transfer, _window
from tests.support.helpers import main_thread_is_in

# Every interrupt below is delivered as SIGINT, which must raise however the suite started.
pytestmark = pytest.mark.usefixtures("interruptible")

LEAF = 64 << 10  # bytes of each leaf below


def _state():
    return {f"l{i}": jnp.full(LEAF // 4, i, jnp.float32) for i in range(6)}


class _Watchdog:
    """Interrupts the main thread again if the code under test has not returned after
    `seconds`: a restore that would hang then fails the test instead of stalling it."""

    def __init__(self, seconds=20.0):
        self.done = threading.Event()
        self.fired = False

        def watch():
            if not self.done.wait(seconds):
                self.fired = True
                _thread.interrupt_main()

        threading.Thread(target=watch, daemon=True).start()


def _raise_system_exit(signum, frame):
    raise SystemExit("terminated by a signal handler")


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_just_after_a_group_is_taken_stops_the_restore_and_frees_its_window(
    tmp_path, monkeypatch, interrupt
):
    checkpoints.save_checkpoint(tmp_path, _state(), 1)
    if interrupt is SystemExit:  # as a program that exits on SIGTERM/SIGINT would
        monkeypatch.setattr(signal, "getsignal", signal.getsignal)
        previous = signal.signal(signal.SIGINT, _raise_system_exit)
    taken = []

    def group_taken():
        taken.append(threading.current_thread() is threading.main_thread())
        if len(taken) == 1:
            _thread.interrupt_main()  # lands before the group's first leaf is placed

    monkeypatch.setattr(_transfer, "group_taken", group_taken)
    before = _window.held_bytes()
    watchdog = _Watchdog()
    start = time.perf_counter()
    try:
        with pytest.raises(interrupt):
            # A window of one leaf: the reader waits for the bytes of the group taken.
            checkpoints.restore_checkpoint(tmp_path, _state(), host_window_bytes=LEAF)
    finally:
        watchdog.done.set()
        if interrupt is SystemExit:
            # set above, where interrupt is SystemExit too
            signal.signal(signal.SIGINT, previous)  # pyright: ignore[reportPossiblyUnboundVariable]
    elapsed = time.perf_counter() - start
    assert taken[0] is True  # the hook ran in the restoring thread, on the first group
    assert not watchdog.fired and elapsed < 10, f"the restore hung for {elapsed:.1f} s"
    assert _window.held_bytes() == before  # every window byte let go
    assert not [t for t in threading.enumerate() if t.name.startswith("eqx_train-restore-read")]


def test_an_interrupted_restore_can_be_done_again(tmp_path, monkeypatch):
    checkpoints.save_checkpoint(tmp_path, _state(), 1)
    monkeypatch.setattr(_transfer, "group_taken", lambda: _thread.interrupt_main())
    watchdog = _Watchdog()
    try:
        with pytest.raises(KeyboardInterrupt):
            checkpoints.restore_checkpoint(tmp_path, _state(), host_window_bytes=LEAF)
    finally:
        watchdog.done.set()
    assert not watchdog.fired
    monkeypatch.undo()
    restored = checkpoints.restore_checkpoint(tmp_path, _state(), host_window_bytes=LEAF)
    assert all(np.array_equal(restored[k], v) for k, v in _state().items())


def test_a_reader_waiting_for_window_bytes_stops_when_the_window_is_cancelled():
    window = _window.HostWindow(10)
    window.acquire(10)
    stopped = []

    def wait_for_room():
        try:
            window.acquire(5)
        except _window.Cancelled:
            stopped.append(True)

    waiter = threading.Thread(target=wait_for_room)
    waiter.start()
    window.cancel()
    waiter.join(10)
    assert stopped == [True]
    window.release_all()
    assert window.in_use == 0


# ------------------------------------------------------------------ waiting for an async save


def _interrupt_once_blocked_in(function_name):
    """A thread that sends SIGINT to the main thread once the main thread is seen blocked
    inside `function_name` (so the interrupt provably lands in that wait).

    A signal that arrives just before the main thread enters the lock wait is only seen
    once the wait ends (CPython's lock waits do not watch for it), so while the main thread
    stays blocked there a second later, SIGINT is sent again."""
    main = threading.main_thread().ident
    assert main is not None

    def send():
        deadline = time.monotonic() + 30
        while not main_thread_is_in(function_name) and time.monotonic() < deadline:
            time.sleep(0.005)
        signal.pthread_kill(main, signal.SIGINT)
        for _ in range(30):
            time.sleep(1.0)
            if not main_thread_is_in(function_name):
                return
            signal.pthread_kill(main, signal.SIGINT)  # the first was lost

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def _writer_that_fails_when_told(monkeypatch):
    """The first save's writer waits for `go`, then fails (disk full); later saves write."""
    go, writing = threading.Event(), threading.Event()
    real = _format.write_all

    def write_all(fd, data):
        if writing.is_set() and go.is_set():
            return real(fd, data)
        writing.set()
        assert go.wait(60), "the test never let the writer go on"
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_format, "write_all", write_all)
    return go, writing


@pytest.mark.parametrize("wait", ["wait_previous_save", "next save", "manager close"])
def test_an_interrupt_while_waiting_for_an_async_save_leaves_it_tracked(
    tmp_path, monkeypatch, wait
):
    go, writing = _writer_that_fails_when_told(monkeypatch)
    manager: Any  # a CheckpointManager or an AsyncManager, each used as its own kind below
    if wait == "manager close":
        manager = checkpoints.CheckpointManager(tmp_path / "m", async_save=True)
        manager.save(1, _state())
        waiting_for_it = manager.close
    else:
        manager = checkpoints.AsyncManager()
        checkpoints.save_checkpoint(tmp_path, _state(), 1, async_manager=manager)
        if wait == "wait_previous_save":
            waiting_for_it = manager.wait_previous_save
        else:  # a third save must wait for the first: the queue holds two
            checkpoints.save_checkpoint(tmp_path, _state(), 2, async_manager=manager)
            waiting_for_it = lambda: checkpoints.save_checkpoint(  # noqa: E731
                tmp_path, _state(), 3, async_manager=manager
            )
    assert writing.wait(30)
    sender = _interrupt_once_blocked_in("_wait_for")
    with pytest.raises(KeyboardInterrupt):
        waiting_for_it()
    sender.join()
    go.set()  # the save goes on, and fails
    with pytest.raises(OSError, match="No space left"):
        if wait == "manager close":
            manager.close()
        else:
            manager.wait_previous_save()


def test_a_failed_save_that_nobody_waited_for_is_reported_at_exit(tmp_path, monkeypatch, capsys):
    go, writing = _writer_that_fails_when_told(monkeypatch)
    manager = checkpoints.AsyncManager()
    checkpoints.save_checkpoint(tmp_path, _state(), 1, async_manager=manager)
    go.set()
    assert manager.save_future is not None
    assert isinstance(manager.save_future.exception(timeout=60), OSError)
    manager._report_unwaited_failure()  # what the interpreter's exit runs for each manager
    assert "failed and was never waited for: OSError" in capsys.readouterr().err
    with pytest.raises(OSError):  # and it is still there to be raised
        manager.wait_previous_save()
