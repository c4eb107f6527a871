"""Each capability a storage declares changes what the checkpoint code does, whichever
backend declares it: one backend (a dict of bytes, as a user writes it) is run with each
capability on and off, and the behaviour that capability stands for is observed."""

import errno
import itertools

import numpy as np
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints.storage import LocalStorage, StorageBase, register_storage
from tests.support.dict_storage import DictStorage
from tests.support.helpers import latest_path


class Recording(DictStorage):
    """A dict store whose capabilities are set per instance, recording its reads and
    moves; paths in `FAILING` answer every read with `EIO`."""

    def __init__(self, files, **capabilities):
        super().__init__(files)
        for name, value in capabilities.items():
            setattr(self, name, value)
        self.reads: list[tuple[str, int, int]] = []
        self.moves: list[tuple[str, str]] = []

    def read(self, path, offset, size):
        self.reads.append((path, offset, size))
        if path in FAILING:
            raise OSError(errno.EIO, "Input/output error", path)
        return super().read(path, offset, size)

    def move(self, path, new_path):
        self.moves.append((path, new_path))
        if not self.atomic_rename:
            return super().move(path, new_path)
        # One step for a file or a whole directory, as a rename is.
        if self.exists(new_path):
            raise FileExistsError(new_path)
        for key in [k for k in self.files if k == path or k.startswith(path + "/")]:
            self.files[new_path + key[len(path) :]] = self.files.pop(key)


FILES: dict[str, tuple[int, bytes]] = {}
FAILING: set[str] = set()
STORES: list[Recording] = []
_runs = itertools.count()


def _open(url, **capabilities):
    store = Recording(FILES, **capabilities)
    STORES.append(store)
    return store


register_storage("capstore", _open)


@pytest.fixture
def url():
    yield f"capstore://run{next(_runs)}"
    FILES.clear()
    STORES.clear()
    FAILING.clear()


def _tree(value):
    return {"w": np.full((64, 4), float(value), np.float32)}


# ------------------------------------------------------------------------------ cheap_reads


@pytest.mark.parametrize("cheap_reads", [True, False])
def test_cheap_reads_decide_how_a_header_is_read(url, cheap_reads):
    """Cheap: exactly the 8-byte length field first. Not cheap: one larger first request
    that usually holds the whole header, since each request is a round trip."""
    options = {"cheap_reads": cheap_reads}
    path = checkpoints.save_checkpoint(url, _tree(1), 1, storage_options=options)
    checkpoints.restore_checkpoint(path, None, storage_options=options)
    first = next(size for p, offset, size in STORES[-1].reads if p == path and offset == 0)
    assert (first == 8) == cheap_reads


# ----------------------------------------------------------------- os_errors_mean_bad_media


def test_an_eio_on_bad_media_makes_a_manager_restore_fall_back(url):
    options = {"os_errors_mean_bad_media": True}
    manager = checkpoints.CheckpointManager(url, keep_latest=2, storage_options=options)
    for step in (1, 2):
        manager.save(step, _tree(step))
    manager.wait()
    newest = latest_path(url, storage_options=options)
    FAILING.add(newest)
    with pytest.warns(checkpoints.UnreadableCheckpointWarning, match="Input/output"):
        restored = manager.restore(_tree(0))
    np.testing.assert_array_equal(restored["w"], _tree(1)["w"])


def test_an_eio_from_a_network_store_is_raised_and_skips_nothing(url):
    options = {"os_errors_mean_bad_media": False}
    manager = checkpoints.CheckpointManager(url, keep_latest=2, storage_options=options)
    for step in (1, 2):
        manager.save(step, _tree(step))
    manager.wait()
    FAILING.add(latest_path(url, storage_options=options))
    with pytest.raises(OSError, match="Input/output"):
        manager.restore(_tree(0))
    assert checkpoints.available_steps(url, storage_options=options) == [1, 2]


# ---------------------------------------------------------------------------- atomic_rename


def _corrupt_sharded_latest(url, options):
    for step in (1, 2):
        checkpoints.save_checkpoint_multiprocess(
            url, _tree(step), step, keep=2, storage_options=options
        )
    newest = latest_path(url, storage_options=options)
    piece = next(k for k in FILES if k.startswith(newest + "/process_"))
    version, data = FILES[piece]
    FILES[piece] = (version + 1000, data[:-4] + bytes(b ^ 0xFF for b in data[-4:]))
    return newest


@pytest.mark.parametrize("atomic_rename", [True, False])
def test_a_corrupt_shards_directory_is_moved_aside_by_rename_or_object_by_object(
    url, atomic_rename
):
    """With a rename, the directory moves in one step; without, each object is copied and
    removed, the index last, so the checkpoint stays whole under one of its two names."""
    options = {"atomic_rename": atomic_rename}
    newest = _corrupt_sharded_latest(url, options)
    manager = checkpoints.CheckpointManager(url, keep_latest=2, storage_options=options)
    with pytest.warns(checkpoints.UnreadableCheckpointWarning, match="corrupt-"):
        restored = manager.restore(_tree(0))
    np.testing.assert_array_equal(restored["w"], _tree(1)["w"])
    moves = [move for store in STORES for move in store.moves]
    if atomic_rename:
        assert [source for source, _ in moves] == [newest]
    else:
        assert len(moves) > 1 and all(source.startswith(newest + "/") for source, _ in moves)
        assert moves[-1][0] == newest + "/index.safetensors"
    assert not any(key.startswith(newest + "/") for key in FILES)


# ----------------------------------------------------------------------------- stale_by_age


def test_a_store_judged_by_age_bounds_a_multi_process_timeout(url):
    with pytest.raises(ValueError, match=r"timeout_s=10000 is too long"):
        checkpoints.save_checkpoint_multiprocess(
            url, _tree(1), 1, timeout_s=10_000, storage_options={"stale_by_age": True}
        )
    checkpoints.save_checkpoint_multiprocess(
        url, _tree(1), 1, timeout_s=10_000, storage_options={"stale_by_age": False}
    )


# ---------------------------------------------------------------------------- the defaults


def test_storage_base_starts_as_a_store_over_a_network():
    assert (StorageBase.atomic_rename, StorageBase.cheap_reads) == (False, False)
    assert (StorageBase.os_errors_mean_bad_media, StorageBase.save_deadline) == (False, False)
    assert StorageBase.stale_by_age is True


def test_the_local_disk_renames_reads_cheaply_and_trusts_its_errnos():
    local = LocalStorage()
    assert local.atomic_rename and local.cheap_reads and local.os_errors_mean_bad_media
    assert not local.stale_by_age and not local.save_deadline
