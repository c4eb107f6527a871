"""Requests an object-store save and restore make: the same however many checkpoints the
directory retains (issue 22). Counted with an fsspec memory store that counts each
outermost call of its client methods (one call, one request on S3, except that a listing
of more than 1000 keys takes one request per page)."""

import collections
import threading

import fsspec
import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from eqx_train import checkpoints

_COUNTED = [
    "ls", "find", "info", "exists", "cat_file", "cat_ranges", "pipe_file", "rm_file", "rmdir",
    "open",
]  # fmt: skip


class CountingMemoryFileSystem(MemoryFileSystem):
    """fsspec's memory store, counting the calls a checkpoint operation makes."""

    protocol = "countmem"
    counts: collections.Counter = collections.Counter()
    _depth = threading.local()

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, str) and path.startswith("countmem://"):
            path = "memory://" + path.removeprefix("countmem://")
        return MemoryFileSystem._strip_protocol(path)


def _counting(name):
    real = getattr(MemoryFileSystem, name)

    def counted(self, *args, **kwargs):
        depth = getattr(CountingMemoryFileSystem._depth, "n", 0)
        if depth == 0:
            CountingMemoryFileSystem.counts[name] += 1
        CountingMemoryFileSystem._depth.n = depth + 1
        try:
            return real(self, *args, **kwargs)
        finally:
            CountingMemoryFileSystem._depth.n = depth

    return counted


for _name in _COUNTED:
    setattr(CountingMemoryFileSystem, _name, _counting(_name))
fsspec.register_implementation("countmem", CountingMemoryFileSystem, clobber=True)


def _requests(run):
    CountingMemoryFileSystem.counts.clear()
    run()
    return sum(CountingMemoryFileSystem.counts.values())


def _state(step):
    return {"w": np.full(4, step, np.float32), "b": np.arange(3) + step}


def _manager_costs(retained):
    url = f"countmem://requests-manager-{retained}/run"
    manager = checkpoints.CheckpointManager(
        url, keep_latest=retained, keep_best=1, best_metric="loss", handle_sigterm=False
    )
    for step in range(retained + 2):  # full, and retention has run
        manager.save(step, _state(step), metrics={"loss": 1.0 / (step + 1)})
    step = retained + 2
    save = _requests(lambda: manager.save(step, _state(step), metrics={"loss": 0.5}))
    restored = []
    restore = _requests(lambda: restored.append(manager.restore(_state(0))))
    best = _requests(lambda: restored.append(manager.restore(_state(0), step="best")))
    assert manager.all_steps() == list(range(step - retained + 1, step + 1))
    np.testing.assert_array_equal(restored[0]["w"], np.full(4, step))
    np.testing.assert_array_equal(restored[1]["w"], np.full(4, step - 1))
    CountingMemoryFileSystem().rm(f"/requests-manager-{retained}", recursive=True)
    return save, restore, best


def _shards_costs(retained):
    url = f"countmem://requests-shards-{retained}/run"
    for step in range(retained + 2):
        checkpoints.save_checkpoint_multiprocess(url, _state(step), step, keep=retained)
    step = retained + 2
    save = _requests(
        lambda: checkpoints.save_checkpoint_multiprocess(url, _state(step), step, keep=retained)
    )
    restored = []
    restore = _requests(lambda: restored.append(checkpoints.restore_checkpoint(url, _state(0))))
    assert checkpoints.available_steps(url) == list(range(step - retained + 1, step + 1))
    np.testing.assert_array_equal(restored[0]["w"], np.full(4, step))
    CountingMemoryFileSystem().rm(f"/requests-shards-{retained}", recursive=True)
    return save, restore


@pytest.mark.parametrize("layout", ["manager", "shards"])
def test_requests_per_save_and_restore_do_not_grow_with_retained_checkpoints(layout):
    costs = _manager_costs if layout == "manager" else _shards_costs
    few, many = costs(3), costs(12)
    assert few == many, f"requests (save, restore...) with 3 retained: {few}; with 12: {many}"
    assert max(few) < 30, few
