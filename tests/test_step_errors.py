"""Typed step errors: a save refused because its step exists is a `StepExistsError`, a
step asked for and not found is a `StepNotFoundError`, on every path (a file, a `.shards`
directory, a manager, an object store); both stay `ValueError`s, as they were."""

import os
import uuid

import fsspec
import numpy as np
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints import (
    CheckpointManager,
    StepExistsError,
    StepNotFoundError,
)
from eqx_train.checkpoints.pipeline import _directory

STATE = {"w": np.arange(3, dtype=np.float32)}


@pytest.fixture(params=["file", "shards", "memory"])
def saved(request, tmp_path):
    """(directory, save) where step 5 was saved: a file, a `.shards` directory, or a file
    in a `memory://` object store."""
    if request.param == "memory":
        bucket = f"eqx-steps-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        directory = f"memory://{bucket}/run"
        request.addfinalizer(lambda: fsspec.filesystem("memory").rm(bucket, recursive=True))
    else:
        directory = str(tmp_path)
    if request.param == "shards":
        save = checkpoints.save_checkpoint_multiprocess
    else:
        save = checkpoints.save_checkpoint
    save(directory, STATE, 5)
    return directory, save


def test_the_step_errors_are_also_the_errors_they_were():
    assert issubclass(StepExistsError, FileExistsError)
    assert issubclass(StepExistsError, ValueError)
    assert issubclass(StepNotFoundError, FileNotFoundError)
    assert issubclass(StepNotFoundError, ValueError)


def test_saving_an_existing_step_raises_step_exists(saved):
    directory, save = saved
    with pytest.raises(StepExistsError, match=r"step 5 already exists.*overwrite=True"):
        save(directory, STATE, 5)


def test_saving_an_older_step_raises_step_exists(saved):
    directory, save = saved
    with pytest.raises(StepExistsError, match="step 4 is not newer"):
        save(directory, STATE, 4)


def test_a_step_that_appears_while_saving_raises_step_exists(tmp_path, monkeypatch):
    checkpoints.save_checkpoint(tmp_path, STATE, 5)
    # The check before writing saw nothing: another save committed step 5 meanwhile.
    monkeypatch.setattr(_directory, "check_newer", lambda *args, **kwargs: None)
    with pytest.raises(StepExistsError, match="appeared in .* while this save was writing"):
        checkpoints.save_checkpoint(tmp_path, STATE, 5)


def test_restoring_a_missing_step_raises_step_not_found(saved):
    directory, _ = saved
    with pytest.raises(StepNotFoundError, match=r"no checkpoint for step 3.*available steps"):
        checkpoints.restore_checkpoint(directory, STATE, step=3)


def test_planning_a_missing_step_raises_step_not_found(saved):
    directory, _ = saved
    with pytest.raises(StepNotFoundError, match="no checkpoint for step 3"):
        checkpoints.plan_restore(directory, STATE, step=3)


def test_planning_in_a_directory_without_checkpoints_raises_step_not_found(tmp_path):
    with pytest.raises(StepNotFoundError, match="plan_restore: no checkpoint at"):
        checkpoints.plan_restore(tmp_path, STATE)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_the_manager_raises_typed_step_errors(tmp_path, where):
    if where == "memory":
        directory = f"memory://eqx-steps-{os.getpid()}-{uuid.uuid4().hex[:8]}/run"
    else:
        directory = str(tmp_path)
    manager = CheckpointManager(directory, best_metric="loss")
    manager.save(5, STATE)
    with pytest.raises(StepExistsError, match="CheckpointManager.save: .*step 5 already exists"):
        manager.save(5, STATE)
    with pytest.raises(StepNotFoundError, match="no checkpoint for step 3"):
        manager.restore(STATE, step=3)
    with pytest.raises(StepNotFoundError, match="no checkpoint for step 3"):
        manager.metrics(3)
    with pytest.raises(StepNotFoundError, match="usable 'loss' metric"):
        manager.restore(STATE, step="best")


def test_a_missing_step_names_the_call_the_user_made(tmp_path):
    """The restore stages are shared: the error names `restore_checkpoint` or the manager's
    `restore`, whichever the user called, never the other."""
    checkpoints.save_checkpoint(tmp_path, STATE, 5)
    with pytest.raises(StepNotFoundError, match=r"^restore_checkpoint: no checkpoint for step 3"):
        checkpoints.restore_checkpoint(tmp_path, STATE, step=3)
    manager = CheckpointManager(tmp_path)
    with pytest.raises(
        StepNotFoundError, match=r"^CheckpointManager\.restore: no checkpoint for step 3"
    ):
        manager.restore(STATE, step=3)


def test_a_multiprocess_commit_beaten_by_another_saves_index_is_a_step_exists_error(
    tmp_path, monkeypatch
):
    """Two saves of one new step race past the planning check; the one whose index write is
    refused because the other's index is there raises `StepExistsError` on process 0, and
    its peers, told so, raise the same (not a bare `FileExistsError` / `RuntimeError`)."""
    import jax

    from eqx_train.checkpoints.pipeline import _coordination, _multiprocess
    from eqx_train.checkpoints.storage import LocalStorage

    checkpoints.save_checkpoint_multiprocess(str(tmp_path), STATE, 1)  # the winner
    final_dir = str(tmp_path / "checkpoint_1.shards")
    token = "0bbfd16a-1-0123456789abcdef"

    def commit() -> None:
        _multiprocess.write_and_commit(
            LocalStorage(), final_dir, token, "save-1-step-1", ([], {}), [], {}, timeout_s=5,
            overwrite=False, after_commit=lambda: None,
        )  # fmt: skip

    with pytest.raises(StepExistsError, match="overwrite=True") as raised:
        commit()
    assert isinstance(raised.value, FileExistsError) and isinstance(raised.value, ValueError)
    assert checkpoints.restore_checkpoint(str(tmp_path), None)["w"].tolist() == [0, 1, 2]

    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(_coordination, "gather", lambda op, value, **kw: ["ok", value])
    said = f"StepExistsError: {raised.value}"
    monkeypatch.setattr(_coordination, "broadcast", lambda op, value, **kw: said)
    with pytest.raises(StepExistsError, match="did not commit"):
        commit()
