"""How an error learns the public call it comes from: the name is set once where the call
crosses the API boundary (`calling`) and read where the message is built (`call`); work
handed to another thread keeps it (`in_context`)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints._errors import call, calling, in_context


def test_outside_any_public_call_the_default_is_named():
    assert call() == "eqx_train"
    assert call("CheckpointManager") == "CheckpointManager"


def test_the_outermost_public_call_wins_and_is_restored_after():
    with calling("CheckpointManager.save"):
        with calling("save_checkpoint"):  # the save a manager runs underneath
            assert call() == "CheckpointManager.save"
        assert call() == "CheckpointManager.save"
    assert call() == "eqx_train"


def test_the_name_is_restored_when_the_call_raises():
    with pytest.raises(KeyError), calling("restore_checkpoint"):
        raise KeyError("x")
    assert call() == "eqx_train"


def test_a_thread_keeps_the_name_of_the_call_that_handed_it_work():
    seen = []
    with calling("restore_checkpoint"):
        work = in_context(lambda: seen.append(call()))
    plain = threading.Thread(target=lambda: seen.append(call()))
    wrapped = threading.Thread(target=work)
    for thread in (plain, wrapped):
        thread.start()
        thread.join()
    assert seen == ["eqx_train", "restore_checkpoint"]


def test_a_pool_runs_one_wrapped_function_on_several_threads_at_once():
    barrier = threading.Barrier(4)

    def name(_: int) -> str:
        barrier.wait(timeout=10)  # all four inside the wrapper together
        return call()

    with calling("load_sharded"):
        wrapped = in_context(name)
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(wrapped, range(4))) == ["load_sharded"] * 4


def test_an_async_manager_save_error_names_the_managers_call(tmp_path):
    """The error of a background save is raised by the next call, naming the save."""
    manager = checkpoints.CheckpointManager(tmp_path, async_save=True)
    with pytest.raises(ValueError, match=r"^CheckpointManager\.save: .*step 1 already exists"):
        manager.save(1, {"w": np.zeros(2)})
        manager.save(1, {"w": np.zeros(2)})
        manager.wait()
    manager.close()
