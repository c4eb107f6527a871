"""`PartialRestoreWarning`: it points at the user's call (its file and line), so
that Python's default filter shows it once per call site and `-W error::...:module`
filters work, whichever function and layout restored."""

import warnings

import numpy as np
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints import CheckpointManager, PartialRestoreWarning


@pytest.fixture(params=["file", "shards"])
def directory(request, tmp_path):
    tree = {"a": np.ones(2, np.float32), "b": np.ones(2, np.float32)}
    if request.param == "file":
        checkpoints.save_checkpoint(tmp_path, tree, 1)
    else:
        checkpoints.save_checkpoint_multiprocess(tmp_path, tree, 1)
    return tmp_path


@pytest.mark.parametrize("how", ["restore_checkpoint", "manager", "manager step"])
def test_the_warning_points_at_the_line_that_restored(directory, how):
    target = {"a": np.zeros(2, np.float32)}
    manager = CheckpointManager(directory, handle_sigterm=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "restore_checkpoint":
            checkpoints.restore_checkpoint(directory, target, strict=False)
        elif how == "manager":
            manager.restore(target, strict=False)
        else:
            manager.restore(target, step=1, strict=False)
    manager.close()
    [warning] = caught
    assert warning.category is PartialRestoreWarning
    assert warning.filename == __file__
