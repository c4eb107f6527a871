"""Restoring into a model that changed since the save: `strict=False` (and its warning),
`rename=`, `casting=`, `plan_restore`, and `inspect --tree`; on single-file and `.shards`
checkpoints and through `CheckpointManager.restore`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eqx_train import checkpoints
from eqx_train._cli import main
from eqx_train.checkpoints import (
    CheckpointManager,
    PartialRestoreWarning,
    RestorePlan,
    plan_restore,
    restore_checkpoint,
)
from eqx_train.checkpoints.format import _reader
from tests.support.helpers import assert_trees_equal, flip_last_byte


def _mlp(seed, dtype=None):
    mlp = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(seed))
    if dtype is None:
        return mlp
    return jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, mlp)


def _bf16(tree):
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, tree)


class Net(eqx.Module):
    encoder: eqx.nn.MLP
    head: eqx.nn.Linear | None


class RenamedNet(eqx.Module):
    enc: eqx.nn.MLP
    head: eqx.nn.Linear | None


@pytest.fixture(params=["file", "shards"])
def save(request, tmp_path):
    """Saves a tree as a single file or a `.shards` directory; returns the directory."""

    def save(tree, step=1):
        if request.param == "file":
            checkpoints.save_checkpoint(tmp_path, tree, step)
        else:
            path = checkpoints.save_checkpoint_multiprocess(tmp_path, tree, step)
            assert path.endswith(".shards")
        return tmp_path

    return save


MLP_NAMES = ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"]


# ----------------------------------------------------------------------- strict=False


def test_an_added_head_keeps_its_values_and_the_warning_names_it(save):
    saved = Net(_mlp(0), None)
    directory = save(saved)
    target = Net(_mlp(1), eqx.nn.Linear(2, 3, key=jax.random.key(2)))
    with pytest.warns(PartialRestoreWarning) as caught:
        restored = restore_checkpoint(directory, target, strict=False)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "2 target leaves kept the target's values" in message
    assert "'head.weight'" in message and "'head.bias'" in message
    assert "unused" not in message
    assert_trees_equal(restored.encoder, saved.encoder)
    assert restored.head is not None and target.head is not None
    assert_trees_equal(restored.head, target.head)


def test_a_smaller_target_warns_of_the_saved_tensors_it_left_unused(save):
    directory = save(Net(_mlp(0), eqx.nn.Linear(2, 3, key=jax.random.key(2))))
    with pytest.warns(PartialRestoreWarning, match=r"2 saved tensors went unused: 'head\.") as w:
        restore_checkpoint(directory, Net(_mlp(1), None), strict=False)
    assert "kept" not in str(w[0].message)


def test_the_warning_names_the_first_five_then_counts_the_rest(tmp_path):
    checkpoints.save_checkpoint(tmp_path, {f"w{i}": np.ones(1) for i in range(8)}, 1)
    with pytest.warns(PartialRestoreWarning) as caught:
        restore_checkpoint(tmp_path, {"w0": np.zeros(1)}, strict=False)
    message = str(caught[0].message)
    assert "7 saved tensors went unused: 'w1', 'w2', 'w3', 'w4', 'w5' and 2 more" in message


def test_a_full_match_with_strict_false_does_not_warn(save):
    directory = save(_mlp(0))
    restored = restore_checkpoint(directory, _mlp(1), strict=False)  # warnings are errors
    assert_trees_equal(restored, _mlp(0))


# ----------------------------------------------------------------------------- rename


def test_a_renamed_field_restores_through_a_prefix_rename(save):
    saved = RenamedNet(_mlp(0), eqx.nn.Linear(2, 3, key=jax.random.key(2)))
    directory = save(saved)
    target = Net(_mlp(1), eqx.nn.Linear(2, 3, key=jax.random.key(3)))
    restored = restore_checkpoint(directory, target, rename={"encoder": "enc"})
    assert_trees_equal(restored, Net(saved.enc, saved.head))


def test_the_root_prefix_loads_an_encoder_from_a_full_model(save):
    full = Net(_mlp(0), eqx.nn.Linear(2, 3, key=jax.random.key(2)))
    directory = save(full)
    with pytest.warns(PartialRestoreWarning, match="'head.weight', 'head.bias'"):
        encoder = restore_checkpoint(directory, _mlp(1), rename={"": "encoder"}, strict=False)
    assert_trees_equal(encoder, full.encoder)


def test_an_empty_saved_prefix_loads_a_standalone_encoder_into_a_full_model(save):
    directory = save(_mlp(0))
    target = Net(_mlp(1), None)
    restored = restore_checkpoint(directory, target, rename={"encoder": ""})
    assert_trees_equal(restored.encoder, _mlp(0))


def test_prefixes_match_whole_segments_and_the_longest_wins(tmp_path):
    names = ["a.x", "c.1.w", "c.10.w", "c.1.b", "cc.w", "d"]
    checkpoints.save_checkpoint(tmp_path, {n: np.ones(1) for n in names}, 1)
    target = {"b": {"x": np.zeros(1)}, "enc": {"1": {"w": np.zeros(1), "b": np.zeros(1)}}}
    target |= {"enc": target["enc"] | {"10": {"w": np.zeros(1)}}, "cc": {"w": np.zeros(1)}}
    target["d"] = np.zeros(1)
    rename = {"b": "a", "enc": "c", "enc.1.b": "c.1.b", "cc": "cc"}
    plan = plan_restore(tmp_path, target, rename=rename)
    assert plan.taken == {
        "b.x": "a.x",
        "cc.w": "cc.w",
        "d": "d",
        "enc.1.b": "c.1.b",
        "enc.1.w": "c.1.w",
        "enc.10.w": "c.10.w",
    }
    assert plan.ok


def test_a_longer_prefix_overrides_a_shorter_one(tmp_path):
    checkpoints.save_checkpoint(tmp_path, {"old": {"w": np.ones(1)}, "b": np.full(1, 2.0)}, 1)
    target = {"new": {"w": np.zeros(1), "b": np.zeros(1)}}
    plan = plan_restore(tmp_path, target, rename={"new": "old", "new.b": "b"})
    assert plan.taken == {"new.b": "b", "new.w": "old.w"} and plan.ok


def test_a_prefix_does_not_match_part_of_a_segment(tmp_path):
    checkpoints.save_checkpoint(tmp_path, {"encoder": {"w": np.ones(1)}}, 1)
    plan = plan_restore(tmp_path, {"encoder": {"w": np.zeros(1)}}, rename={"enc": "x"})
    assert plan.problems == ["rename {'enc': 'x'}: no target leaf is named 'enc' or under it"]


def test_two_target_leaves_may_take_one_saved_tensor(save):
    directory = save({"embed": jnp.arange(6.0).reshape(2, 3)})
    target = {"embed": jnp.zeros((2, 3)), "unembed": jnp.zeros((2, 3))}
    restored = restore_checkpoint(directory, target, rename={"unembed": "embed"})
    np.testing.assert_array_equal(restored["embed"], np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(restored["unembed"], np.arange(6.0).reshape(2, 3))


def test_a_rename_to_a_missing_saved_tensor_is_a_problem_naming_both(save):
    directory = save(_mlp(0))
    with pytest.raises(ValueError) as info:
        restore_checkpoint(directory, Net(_mlp(1), None), rename={"encoder": "enc"})
    message = str(info.value)
    assert (
        "'encoder.layers.0.weight' (from saved 'enc.layers.0.weight' by rename): missing from "
        "the file, target expects (4, 2) float32"
    ) in message


def test_with_strict_false_a_rename_finding_nothing_is_still_a_problem(save):
    directory = save(_mlp(0))
    with pytest.raises(ValueError, match=r"rename \{'encoder': 'enc'\}: the file has no tensor"):
        restore_checkpoint(directory, Net(_mlp(1), None), rename={"encoder": "enc"}, strict=False)


def test_a_rename_function_maps_names_and_none_keeps_the_target_value(save):
    saved = {"w_old": np.full(2, 1.0), "b": np.full(2, 2.0)}
    directory = save(saved)
    target = {"w": np.zeros(2), "b": np.zeros(2), "fresh": np.full(2, 9.0)}

    def rename(name):
        return {"w": "w_old", "fresh": None}.get(name, name)

    restored = restore_checkpoint(directory, target, rename=rename)
    assert_trees_equal(restored, {"w": saved["w_old"], "b": saved["b"], "fresh": target["fresh"]})


def test_a_rename_function_returning_a_non_string_is_refused_naming_the_leaf(tmp_path):
    checkpoints.save_checkpoint(tmp_path, {"w": np.ones(1)}, 1)
    with pytest.raises(TypeError, match=r"rename\('w'\) returned 3"):
        restore_checkpoint(tmp_path, {"w": np.zeros(1)}, rename=lambda name: 3)  # pyright: ignore[reportCallIssue, reportArgumentType]  # a wrong value on purpose


def test_rename_and_casting_of_the_wrong_kind_are_refused(tmp_path, without_type_checks):
    with pytest.raises(ValueError, match="casting must be one of"):
        restore_checkpoint(tmp_path, {}, casting="float")  # pyright: ignore[reportCallIssue, reportArgumentType]  # a wrong value on purpose
    with pytest.raises(TypeError, match="rename must be a mapping"):
        restore_checkpoint(tmp_path, {}, rename={"a": 1})  # pyright: ignore[reportCallIssue, reportArgumentType]  # a wrong value on purpose


# ---------------------------------------------------------------------------- casting


def test_float32_into_bfloat16_needs_same_kind_and_the_refusal_says_so(save):
    directory = save(_mlp(0))
    target = _mlp(1, jnp.bfloat16)
    with pytest.raises(ValueError) as info:
        restore_checkpoint(directory, target)
    assert (
        "'layers.0.weight': file has (4, 2) float32, target expects (4, 2) bfloat16; "
        "casting='same_kind' would allow it (now casting='no')"
    ) in str(info.value)
    with pytest.raises(ValueError, match="casting='same_kind' would allow it"):
        restore_checkpoint(directory, target, casting="safe")
    restored = restore_checkpoint(directory, target, casting="same_kind")
    reference = jax.tree.map(
        lambda x: np.asarray(x).astype(ml_dtypes.bfloat16) if eqx.is_array(x) else x, _mlp(0)
    )
    assert_trees_equal(restored, reference)


def test_a_safe_cast_is_allowed_by_safe(save):
    directory = save({"w": np.arange(3, dtype=np.float16)})
    restored = restore_checkpoint(directory, {"w": jnp.zeros(3)}, casting="safe")
    assert restored["w"].dtype == jnp.float32
    np.testing.assert_array_equal(restored["w"], [0.0, 1.0, 2.0])


def test_a_cast_that_overflows_gives_inf_as_numpy_does(save):
    directory = save({"w": np.array([1e6, -1e6, 1.0], np.float32)})
    restored = restore_checkpoint(directory, {"w": jnp.zeros(3, jnp.float16)}, casting="same_kind")
    np.testing.assert_array_equal(restored["w"], np.array([np.inf, -np.inf, 1.0], np.float16))


def test_a_renamed_cast_leaf_keeps_a_sharding_over_eight_devices(save):
    mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    directory = save({"w_old": np.arange(32.0, dtype=np.float32).reshape(8, 4)})
    target = {"w": jax.device_put(jnp.zeros((8, 4), jnp.bfloat16), sharding)}
    restored = restore_checkpoint(directory, target, rename={"w": "w_old"}, casting="same_kind")
    assert restored["w"].sharding == sharding and restored["w"].dtype == jnp.bfloat16
    expected = np.arange(32.0).reshape(8, 4).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(restored["w"]), expected)


def test_prng_keys_are_never_cast(save):
    saved = {"key": jax.random.key(7), "w": np.ones(2, np.float32)}
    directory = save(saved)
    target = {"key": jax.random.key(0), "w": jnp.zeros(2, jnp.bfloat16)}
    restored = restore_checkpoint(directory, target, casting="unsafe")
    assert_trees_equal(restored["key"], saved["key"])
    # A key whose saved data has another dtype is refused, whatever the casting.
    directory = save({"key": np.zeros(2, np.uint8), "w": np.ones(2, np.float32)}, step=2)
    with pytest.raises(ValueError, match=r"'key': file has \(2,\) uint8.*never cast"):
        restore_checkpoint(directory, target, step=2, casting="unsafe")


# ------------------------------------------------------------ configuration unchanged


class WithDropout(eqx.Module):
    drop: eqx.nn.Dropout
    w: jax.Array


def test_module_configuration_follows_config_through_a_rename(save):
    class Renamed(eqx.Module):
        dropout: eqx.nn.Dropout
        w: jax.Array

    directory = save(WithDropout(eqx.nn.Dropout(0.5), jnp.ones(2)))
    target = Renamed(eqx.nn.Dropout(0.1), jnp.zeros(2, jnp.bfloat16))
    options = {"rename": {"dropout": "drop"}, "casting": "same_kind"}
    with pytest.warns(checkpoints.ConfigMismatchWarning, match="'dropout.p': saved 0.5"):
        kept = restore_checkpoint(directory, target, **options)
    assert kept.dropout.p == 0.1 and kept.w.dtype == jnp.bfloat16
    taken = restore_checkpoint(directory, target, config="saved", **options)
    assert taken.dropout.p == 0.5


# ----------------------------------------------------------------------- plan_restore


def test_a_plan_lists_taken_cast_kept_and_unused(save):
    directory = save({"enc": _mlp(0), "old_head": np.ones(3, np.float32)})
    target = Net(_mlp(1, jnp.bfloat16), eqx.nn.Linear(2, 3, key=jax.random.key(2)))
    plan = plan_restore(
        directory, target, rename={"encoder": "enc"}, casting="same_kind", strict=False
    )
    assert isinstance(plan, RestorePlan) and plan.ok
    assert plan.taken == {f"encoder.{n}": f"enc.{n}" for n in MLP_NAMES}
    f32, bf16 = np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)
    assert plan.cast == {f"encoder.{n}": (f32, bf16) for n in MLP_NAMES}
    assert plan.kept == ["head.weight", "head.bias"]
    assert plan.unused == ["old_head"]
    text = str(plan)
    assert "would succeed" in text
    assert [
        "encoder.layers.0.weight",
        "enc.layers.0.weight",
        "cast",
        "float32",
        "->",
        "bfloat16",
    ] in [line.split() for line in text.splitlines()]
    assert ["head.bias", "-", "kept", "(target's", "value)"] in [
        line.split() for line in text.splitlines()
    ]
    assert ["-", "old_head", "unused"] in [line.split() for line in text.splitlines()]


def test_a_plans_problems_are_the_lines_the_restore_refuses_with(save):
    directory = save({"enc": _mlp(0), "extra": np.ones(1)})
    target = Net(_mlp(1, jnp.bfloat16), None)
    plan = plan_restore(directory, target, rename={"encoder": "enc"})
    assert not plan.ok and len(plan.problems) == 5
    assert "would fail (5 problems)" in str(plan)
    with pytest.raises(ValueError) as info:
        restore_checkpoint(directory, target, rename={"encoder": "enc"})
    listed = [line.strip() for line in str(info.value).splitlines()]
    assert all(problem in listed for problem in plan.problems)


def test_a_plan_reads_no_tensor_data(save, monkeypatch):
    directory = save({"w": np.ones(3, np.float32)})

    def no_reads(*args, **kwargs):
        raise AssertionError("plan_restore read tensor data")

    monkeypatch.setattr(_reader.FileReader, "read", no_reads)
    monkeypatch.setattr(_reader.FileReader, "read_many", no_reads)
    plan = plan_restore(directory, {"w": jnp.zeros(3, jnp.bfloat16)}, casting="same_kind")
    assert plan.ok and list(plan.cast) == ["w"]


def test_a_plan_without_a_checkpoint_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="plan_restore: no checkpoint"):
        plan_restore(tmp_path, {"w": np.zeros(1)})


# ----------------------------------------------------------- CheckpointManager.restore


def test_the_manager_restores_a_changed_model_past_a_corrupt_newest_checkpoint(tmp_path):
    with CheckpointManager(tmp_path, keep_latest=2) as manager:
        for step in (1, 2):
            manager.save(step, RenamedNet(_mlp(step), None))
    flip_last_byte(tmp_path / "checkpoint_2.safetensors")
    target = Net(_mlp(9, jnp.bfloat16), eqx.nn.Linear(2, 3, key=jax.random.key(2)))
    with CheckpointManager(tmp_path) as manager:
        with pytest.warns(checkpoints.UnreadableCheckpointWarning, match="restored step 1"):
            with pytest.warns(PartialRestoreWarning, match="'head.weight', 'head.bias'"):
                restored = manager.restore(
                    target, rename={"encoder": "enc"}, casting="same_kind", strict=False
                )
    assert_trees_equal(restored.encoder, _bf16(_mlp(1)))


def test_the_manager_restores_the_best_step_into_a_changed_model(tmp_path):
    with CheckpointManager(tmp_path, keep_best=1, best_metric="loss") as manager:
        for step, loss in ((1, 0.1), (2, 0.5)):
            manager.save(step, {"enc": _mlp(step)}, metrics={"loss": loss})
        target = {"encoder": _mlp(9, jnp.bfloat16)}
        with pytest.raises(ValueError, match="casting='same_kind' would allow it"):
            manager.restore(target, step="best", rename={"encoder": "enc"})
        best = manager.restore(target, step="best", rename={"encoder": "enc"}, casting="same_kind")
    assert_trees_equal(best["encoder"], _bf16(_mlp(1)))


def test_the_manager_restore_takes_strict(tmp_path):
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, {"w": np.ones(2)})
        with pytest.raises(ValueError, match="'new': missing from the file"):
            manager.restore({"w": np.zeros(2), "new": np.zeros(1)}, step=1)
        with pytest.warns(PartialRestoreWarning, match="'new'"):
            restored = manager.restore({"w": np.zeros(2), "new": np.zeros(1)}, step=1, strict=False)
    np.testing.assert_array_equal(restored["w"], np.ones(2))


# ---------------------------------------------------------------------- inspect --tree


def test_inspect_tree_lists_full_names_under_each_prefix(tmp_path, capsys):
    checkpoints.save_checkpoint(
        tmp_path, Net(_mlp(0), eqx.nn.Linear(2, 3, key=jax.random.key(1))), 1
    )
    assert main(["inspect", str(tmp_path), "--tree"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["encoder", "4", "tensors"] in lines
    assert ["encoder.layers.0", "2", "tensors"] in lines
    assert ["encoder.layers.0.weight", "float32[4,", "2]"] in lines
    assert ["head", "2", "tensors"] in lines and ["head.bias", "float32[3]"] in lines
