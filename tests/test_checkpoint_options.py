"""A public call's keyword arguments become one frozen options object, checked once; flax's
`parallel` is `threaded_reads` (reading a local file's tensors with several threads), and
the newer name, when given, wins."""

import dataclasses
import threading

import numpy as np
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints.format import _reader
from eqx_train.checkpoints.pipeline._options import RestoreOptions, SaveOptions
from eqx_train.interop import load_sharded, save_sharded

MiB = 1 << 20
# Two tensors of 9 MiB: together past the 16 MiB from which a local file reads in threads.
STATE = {"a": np.ones(9 * MiB // 4, np.float32), "b": np.zeros(9 * MiB // 4, np.float32)}


@pytest.fixture
def reading_threads(monkeypatch):
    """The threads that read tensors from a checkpoint file, as the restore runs."""
    threads = set()
    real = _reader.FileReader._fill  # every read of a whole tensor from a local file

    def fill(self, info, out, verify):
        threads.add(threading.current_thread())
        return real(self, info, out, verify)

    monkeypatch.setattr(_reader.FileReader, "_fill", fill)
    return threads


def test_a_restore_reads_large_tensors_in_threads_by_default(tmp_path, reading_threads):
    path = checkpoints.save_checkpoint(tmp_path, STATE, 1)
    checkpoints.restore_checkpoint(path, None)
    assert threading.main_thread() not in reading_threads


@pytest.mark.parametrize(
    "keywords", [{"threaded_reads": False}, {"parallel": False}], ids=["threaded_reads", "parallel"]
)
def test_threaded_reads_false_and_flax_parallel_false_read_on_the_calling_thread(
    tmp_path, reading_threads, keywords
):
    path = checkpoints.save_checkpoint(tmp_path, STATE, 1)
    restored = checkpoints.restore_checkpoint(path, None, **keywords)
    assert reading_threads == {threading.main_thread()}
    assert restored["a"].tolist() == STATE["a"].tolist()


def test_threaded_reads_when_given_wins_over_parallel(tmp_path, reading_threads):
    path = checkpoints.save_checkpoint(tmp_path, STATE, 1)
    checkpoints.restore_checkpoint(path, None, parallel=True, threaded_reads=False)
    assert reading_threads == {threading.main_thread()}
    reading_threads.clear()
    checkpoints.restore_checkpoint(path, None, parallel=False, threaded_reads=True)
    assert threading.main_thread() not in reading_threads


def test_load_sharded_takes_threaded_reads_as_restore_checkpoint_does(tmp_path, reading_threads):
    save_sharded(tmp_path, STATE)
    load_sharded(tmp_path, threaded_reads=False)
    assert reading_threads == {threading.main_thread()}


def test_the_options_objects_are_frozen():
    for options in (RestoreOptions(), SaveOptions()):
        with pytest.raises(dataclasses.FrozenInstanceError):
            options.host_window_bytes = 1  # type: ignore[misc]


def test_an_options_error_names_the_public_call_the_user_made(tmp_path, without_type_checks):
    # Each call passes a value its type excludes, on purpose: the check at run time is tested.
    with pytest.raises(ValueError, match="^restore_checkpoint: casting must be one of"):
        checkpoints.restore_checkpoint(tmp_path, STATE, casting="sometimes")  # pyright: ignore[reportArgumentType, reportCallIssue]
    with pytest.raises(ValueError, match="^plan_restore: casting must be one of"):
        checkpoints.plan_restore(tmp_path, STATE, casting="sometimes")  # pyright: ignore[reportArgumentType, reportCallIssue]
    with pytest.raises(ValueError, match="^load_sharded: casting must be one of"):
        load_sharded(tmp_path, STATE, casting="sometimes")  # pyright: ignore[reportArgumentType, reportCallIssue]
    with pytest.raises(ValueError, match="^save_checkpoint: snapshot must be one of"):
        checkpoints.save_checkpoint(tmp_path, STATE, 1, snapshot="gpu")  # pyright: ignore[reportArgumentType, reportCallIssue]
