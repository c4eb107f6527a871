"""`plan_restore`: for every case of a table (casts, renames, strict, filters,
typed keys, Python scalars, Equinox models; single-file and `.shards`), the plan and the
restore agree. A plan that says ok is a restore that succeeds; a plan with problems is a
restore refused with every one of those lines. What only a restore can know (whether a
Python scalar's saved value converts exactly) is the one documented exception."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from eqx_train import checkpoints
from eqx_train.checkpoints import PartialRestoreWarning, plan_restore, restore_checkpoint
from eqx_train.checkpoints.format import _reader, _shards


class Block(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    dropout: eqx.nn.Dropout
    key: jax.Array
    width: int = eqx.field(static=True)

    def __init__(self, key, dtype=jnp.float32):
        self.linear = eqx.nn.Linear(3, 2, key=key, dtype=dtype)
        self.norm = eqx.nn.BatchNorm(2, "batch", mode="batch", dtype=dtype)
        self.dropout = eqx.nn.Dropout(0.1)
        self.key = jax.random.key(3)
        self.width = 2


def _block(dtype=jnp.float32):
    return eqx.nn.make_with_state(Block)(jax.random.key(1), dtype)


SAVED = {
    "enc": {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(2, np.float32)},
    "count": np.int32(7),
    "mask": np.array([True, False]),
    "key": jax.random.key(0),
    "lr": 0.5,
    "flag": True,
}


def _f32(shape):
    return np.zeros(shape, np.float32)


def _like_saved(**changes):
    tree = {
        "enc": {"w": _f32((2, 3)), "b": _f32(2)},
        "count": np.int32(0),
        "mask": np.zeros(2, bool),
        "key": jax.random.key(9),
        "lr": 0.25,
        "flag": False,
    }
    tree.update(changes)
    return tree


CASES = {
    "identical": (_like_saved(), {}),
    "bfloat16 without casting": (
        _like_saved(enc={"w": jnp.zeros((2, 3), jnp.bfloat16), "b": _f32(2)}),
        {},
    ),
    "bfloat16 same_kind": (
        _like_saved(enc={"w": jnp.zeros((2, 3), jnp.bfloat16), "b": _f32(2)}),
        {"casting": "same_kind"},
    ),
    "float8 unsafe": (
        _like_saved(enc={"w": np.zeros((2, 3), ml_dtypes.float8_e4m3fn), "b": _f32(2)}),
        {"casting": "unsafe"},
    ),
    "bool mask into float32 safe": (_like_saved(mask=_f32(2)), {"casting": "safe"}),
    "int32 count into int8 same_kind": (_like_saved(count=np.int8(0)), {"casting": "same_kind"}),
    "int32 count into int8 safe": (_like_saved(count=np.int8(0)), {"casting": "safe"}),
    "key into another impl": (
        _like_saved(key=jax.random.key(1, impl="rbg")),
        {"casting": "unsafe"},
    ),
    "key into raw uint32": (_like_saved(key=np.zeros(2, np.uint32)), {}),
    "shape change": (_like_saved(enc={"w": _f32((3, 3)), "b": _f32(2)}), {"casting": "unsafe"}),
    "renamed field": (
        {**_like_saved(), "encoder": _like_saved()["enc"], "enc": None},
        {"rename": {"encoder": "enc"}},
    ),
    "rename to a missing prefix": (_like_saved(), {"rename": {"enc": "encoder"}}),
    "rename partial segment": (_like_saved(), {"rename": {"en": "enc"}}),
    "rename function to none": (_like_saved(), {"rename": lambda n: None if n == "lr" else n}),
    "rename with strict=False": (_like_saved(), {"rename": {"enc": "encoder"}, "strict": False}),
    "extra leaf strict": ({**_like_saved(), "head": _f32(3)}, {}),
    "extra leaf not strict": ({**_like_saved(), "head": _f32(3)}, {"strict": False}),
    "fewer leaves not strict": ({"enc": _like_saved()["enc"]}, {"strict": False}),
    "filter_spec inexact": (_like_saved(), {"filter_spec": eqx.is_inexact_array}),
    "bool saved into an int scalar": (_like_saved(flag=0), {}),
    "bool saved into a float scalar": (_like_saved(flag=0.0), {"casting": "unsafe"}),
    "float saved into a numpy float32 scalar": (_like_saved(lr=np.float32(0)), {}),
    "float saved into a numpy float32 scalar same_kind": (
        _like_saved(lr=np.float32(0)),
        {"casting": "same_kind"},
    ),
}


@pytest.fixture(scope="module", params=["file", "shards"])
def saved(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "file":
        checkpoints.save_checkpoint(directory, SAVED, 1)
    else:
        checkpoints.save_checkpoint_multiprocess(directory, SAVED, 1)
    return directory


def _agree(directory, target, options):
    plan = plan_restore(directory, target, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PartialRestoreWarning)
        try:
            restore_checkpoint(directory, target, **options)
        except ValueError as error:
            listed = [line.strip() for line in str(error).splitlines()]
            assert not plan.ok, f"the plan said ok, the restore refused: {error}"
            assert all(problem in listed for problem in plan.problems), (plan.problems, listed)
            return
    assert plan.ok, f"the plan listed {plan.problems}, the restore succeeded"


@pytest.mark.parametrize("case", list(CASES))
def test_the_plan_and_the_restore_agree(saved, case):
    target, options = CASES[case]
    _agree(saved, target, options)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("casting", ["no", "same_kind"])
def test_the_plan_and_the_restore_agree_on_an_equinox_model_and_its_abstract_form(
    tmp_path, dtype, casting
):
    checkpoints.save_checkpoint(tmp_path, _block(), 1)
    _agree(tmp_path, _block(dtype), {"casting": casting})
    _agree(tmp_path, eqx.filter_eval_shape(_block, dtype), {"casting": casting})


def test_only_a_python_scalars_saved_value_is_beyond_a_plan(saved):
    # Whether 0.5 converts exactly into a bool is in the tensor bytes, which a plan never
    # reads: the plan says ok (as documented on `RestorePlan.ok`), the restore refuses,
    # naming the leaf.
    target = _like_saved(lr=False)
    assert plan_restore(saved, target).ok
    with pytest.raises(
        ValueError, match=r"'lr': the file holds 0.5 \(float64\), not exactly a bool"
    ):
        restore_checkpoint(saved, target)


def test_a_plan_for_target_none_says_the_file_loads_as_saved(saved):
    # restore_checkpoint(path, None) loads every tensor as saved: the plan agrees.
    plan = plan_restore(saved, None)
    assert plan.ok and plan.taken == {name: name for name in plan.taken}
    assert sorted(plan.taken) == ["count", "enc.b", "enc.w", "flag", "key", "lr", "mask"]
    assert plan.cast == {} and plan.kept == [] and plan.unused == []
    restore_checkpoint(saved, None)


def test_a_plan_for_target_none_refuses_options_that_need_a_target(saved):
    with pytest.raises(ValueError, match="rename.*target=None"):
        plan_restore(saved, None, rename={"a": "b"})


@pytest.mark.parametrize(
    "option",
    [{"rename": {"b": "a"}}, {"casting": "unsafe"}, {"filter_spec": lambda x: False}],
    ids=["rename", "casting", "filter_spec"],
)
def test_target_options_with_target_none_are_refused_not_ignored(tmp_path, option):
    checkpoints.save_checkpoint(tmp_path, {"a": np.arange(3.0)}, 1)
    (name,) = option
    with pytest.raises(ValueError, match=rf"restore_checkpoint: {name} applies to a target"):
        restore_checkpoint(tmp_path, None, **option)


def test_a_plan_of_a_shards_checkpoint_reads_no_tensor_data(tmp_path, monkeypatch):
    checkpoints.save_checkpoint_multiprocess(tmp_path, SAVED, 1)

    def no_reads(*args, **kwargs):
        raise AssertionError("plan_restore read tensor data")

    for reader in (_reader.FileReader, _shards.ShardedReader):
        monkeypatch.setattr(reader, "read", no_reads)
        monkeypatch.setattr(reader, "read_many", no_reads)
    target = _like_saved(enc={"w": jnp.zeros((2, 3), jnp.bfloat16), "b": _f32(2)})
    plan = plan_restore(tmp_path, target, casting="same_kind")
    assert plan.ok and list(plan.cast) == ["enc.w"]
