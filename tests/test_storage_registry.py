"""A storage backend written by a user (not fsspec: a dict of bytes) and registered by its
URL scheme serves every checkpoint call: saves, restores, listings and a
`CheckpointManager`. Schemes that no backend serves, and registrations that cannot work,
are refused with errors that say what to do."""

import warnings

import numpy as np
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints.storage import Storage, register_storage
from tests.support.dict_storage import DictStorage

# --------------------------------------------------------------------- the user's backend

BUCKETS: dict[str, dict[str, tuple[int, bytes]]] = {}
OPTIONS_SEEN: list[dict] = []


def open_dict_storage(url, **storage_options):
    OPTIONS_SEEN.append(storage_options)
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    return DictStorage(BUCKETS.setdefault(bucket, {}))


register_storage("userdict", open_dict_storage)


@pytest.fixture
def url(request):
    bucket = f"b{len(BUCKETS)}-{request.node.name}"[:60]
    yield f"userdict://{bucket}/run"
    BUCKETS.pop(bucket, None)


# -------------------------------------------------------------------------------- promises


def test_a_registered_backend_saves_and_restores(url):
    tree = {"w": np.arange(6.0).reshape(2, 3), "b": np.ones(3, np.int8)}
    path = checkpoints.save_checkpoint(url, tree, 1)
    assert path == f"{url}/checkpoint_1.safetensors"
    assert path in BUCKETS[url.split("/")[2]]
    restored = checkpoints.restore_checkpoint(url, tree)
    np.testing.assert_array_equal(restored["w"], tree["w"])
    np.testing.assert_array_equal(restored["b"], tree["b"])
    assert restored["b"].dtype == np.int8


def test_a_registered_backend_runs_a_checkpoint_manager(url):
    manager = checkpoints.CheckpointManager(url, keep_latest=2)
    for step in range(5):
        manager.save(step, {"x": np.full(3, float(step))})
    manager.wait()
    assert checkpoints.available_steps(url) == [3, 4]
    assert checkpoints.latest_checkpoint(url) == f"{url}/checkpoint_4.safetensors"
    files = sorted(BUCKETS[url.split("/")[2]])
    assert files == [f"{url}/checkpoint_3.safetensors", f"{url}/checkpoint_4.safetensors"]
    np.testing.assert_array_equal(manager.restore({"x": np.zeros(3)})["x"], np.full(3, 4.0))
    np.testing.assert_array_equal(manager.restore({"x": np.zeros(3)}, step=3)["x"], np.full(3, 3.0))


def test_a_registered_backend_keeps_multi_process_checkpoints(url):
    tree = {"a": np.arange(16.0).reshape(4, 4)}
    path = checkpoints.save_checkpoint_multiprocess(url, tree, 2, timeout_s=60)
    assert path.endswith("checkpoint_2.shards")
    np.testing.assert_array_equal(checkpoints.restore_checkpoint(url, tree)["a"], tree["a"])


def test_storage_options_reach_the_factory(url):
    checkpoints.save_checkpoint(url, {"x": np.zeros(1)}, 1, storage_options={"token": "t"})
    assert OPTIONS_SEEN[-1] == {"token": "t"}


def test_register_storage_is_exported_from_checkpoints():
    assert checkpoints.register_storage is register_storage
    assert "register_storage" in checkpoints.__all__


def test_the_factory_result_is_a_storage(url):
    from eqx_train.checkpoints.storage import _locations

    store, where = _locations.resolve(url)
    assert isinstance(store, Storage) and isinstance(store, DictStorage)
    assert where == url


# ------------------------------------------------------------------------------- refusals


def test_an_unknown_scheme_names_the_scheme_and_register_storage():
    with pytest.raises(ImportError, match=r"'nosuchstore://'.*register_storage"):
        checkpoints.save_checkpoint("nosuchstore://bucket/run", {"x": np.zeros(1)}, 1)
    with pytest.raises(ImportError, match=r"restore_checkpoint.*nosuchstore"):
        checkpoints.restore_checkpoint("nosuchstore://bucket/run", None)


def test_registering_a_scheme_twice_is_refused():
    with pytest.raises(ValueError, match=r"'userdict' already has a storage.*replace=True"):
        register_storage("userdict", open_dict_storage)
    with pytest.raises(ValueError, match=r"'s3' already has a storage"):
        register_storage("S3", open_dict_storage)


def test_replace_true_replaces_a_registration():
    register_storage("userdict2", lambda url, **options: DictStorage({}))
    register_storage("userdict2", open_dict_storage, replace=True)
    checkpoints.save_checkpoint("userdict2://replaced/run", {"x": np.zeros(1)}, 1)
    assert "userdict2://replaced/run/checkpoint_1.safetensors" in BUCKETS.pop("replaced")


@pytest.mark.parametrize("scheme", ["", "s3://", "1abc", "a b", "a.b", 3])
def test_a_scheme_that_is_no_url_scheme_is_refused(scheme, without_type_checks):
    with pytest.raises(ValueError, match=r"register_storage: scheme must be a URL scheme"):
        register_storage(scheme, open_dict_storage)  # type: ignore[arg-type]


def test_a_factory_that_is_not_callable_is_refused(without_type_checks):
    with pytest.raises(TypeError, match=r"register_storage: factory must be a callable"):
        register_storage("notcallable", "open_dict_storage")  # type: ignore[arg-type]


def test_a_factory_that_returns_no_storage_is_refused_naming_the_scheme():
    # A factory returning a dict is the user error this test plants.
    register_storage("notastore", lambda url, **options: {"files": {}})  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"save_checkpoint: .*notastore://.*not a Storage"):
        checkpoints.save_checkpoint("notastore://b/run", {"x": np.zeros(1)}, 1)


def test_urls_of_a_registered_scheme_are_checked_like_any_other(url):
    with pytest.raises(ValueError, match="empty path segment"):
        checkpoints.save_checkpoint(url + "//x", {"x": np.zeros(1)}, 1)
    with pytest.raises(ValueError, match="query or fragment"):
        checkpoints.save_checkpoint(url + "?v=1", {"x": np.zeros(1)}, 1)


def test_a_manager_on_a_registered_backend_warns_of_nothing(url):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        manager = checkpoints.CheckpointManager(url, keep_latest=1)
        manager.save(1, {"x": np.zeros(2)})
        manager.save(2, {"x": np.ones(2)})
        manager.wait()
    assert checkpoints.available_steps(url) == [2]
