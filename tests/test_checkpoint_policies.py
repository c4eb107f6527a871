"""Retention and save policies: each policy's rule on its own (against literal tables), their
validation, composition, and a CheckpointManager built from them (the keyword shorthands
build the same policies; a shorthand and a policy for one thing are refused together)."""

import dataclasses
from decimal import Decimal

import numpy as np
import pytest

from eqx_train.checkpoints import (
    CheckpointManager,
    KeepAny,
    KeepBest,
    KeepEveryNSteps,
    KeepLatest,
    RetentionContext,
    RetentionPolicy,
    SaveAny,
    SaveContext,
    SaveEveryNSeconds,
    SaveEveryNSteps,
    SaveOnPreemption,
    SavePolicy,
)
from eqx_train.checkpoints.manager import _manager, _retention
from eqx_train.checkpoints.pipeline import _coordination


def _context(steps, metrics=None, asked=None):
    """A context over `steps` whose `rank` ranks by the literal `metrics` (step -> value),
    recording each metric asked in `asked`."""
    steps = tuple(Decimal(s) for s in steps)

    def rank(metric, mode):
        if asked is not None:
            asked.append(metric)
        values = metrics or {}
        usable = [s for s in steps if values.get(int(s)) is not None]
        sign = 1 if mode == "min" else -1
        return sorted(usable, key=lambda s: (sign * values[int(s)], -s))

    return RetentionContext(steps, rank)


def _kept(policy, context):
    return sorted(int(s) for s in policy.keep(context))


def _state(value):
    return {"w": np.full(2, value, np.float32)}


# ---------------------------------------------------------------- retention policies


def test_keep_latest_keeps_the_newest_n():
    assert _kept(KeepLatest(2), _context([1, 3, 7, 9])) == [7, 9]
    assert _kept(KeepLatest(5), _context([1, 3])) == [1, 3]


def test_keep_best_keeps_the_best_n_by_its_metric_and_mode():
    metrics = {1: 0.5, 2: 0.1, 3: None, 4: 0.3}
    assert _kept(KeepBest(2, "loss"), _context([1, 2, 3, 4], metrics)) == [2, 4]
    assert _kept(KeepBest(1, "acc", mode="max"), _context([1, 2, 3, 4], metrics)) == [1]


def test_keep_every_n_steps_follows_flaxs_rule():
    # From the oldest: keep a step at least n past the last one kept; never step 0.
    assert _kept(KeepEveryNSteps(3), _context([0, 1, 2, 3, 4, 5, 6, 7, 8])) == [1, 4, 7]
    assert _kept(KeepEveryNSteps(2.5), _context([0, 2, 3, 5, 6, 9])) == [2, 5, 9]


def test_keep_any_keeps_what_any_member_keeps():
    policy = KeepAny(KeepLatest(1), KeepBest(1, "loss"))
    assert _kept(policy, _context([1, 2, 3], {1: 0.1, 2: 0.9, 3: 0.5})) == [1, 3]


def test_keep_any_asks_no_more_members_once_everything_is_kept():
    asked: list[str] = []
    policy = KeepAny(KeepLatest(3), KeepBest(1, "loss"))
    assert _kept(policy, _context([1, 2, 3], {1: 0.1}, asked)) == [1, 2, 3]
    assert asked == []  # the metrics were never read


def test_a_user_policy_is_any_object_with_keep():
    class KeepEven:
        def keep(self, context):
            return {s for s in context.steps if s % 2 == 0}

    assert isinstance(KeepEven(), RetentionPolicy)
    assert _kept(KeepAny(KeepLatest(1), KeepEven()), _context([1, 2, 3, 4, 5])) == [2, 4, 5]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: KeepLatest(0), r"KeepLatest: n must be an int >= 1, got 0"),
        (lambda: KeepLatest(True), r"KeepLatest: n must be an int >= 1, got True"),
        (lambda: KeepBest(0, "loss"), r"KeepBest: n must be an int >= 1, got 0"),
        (lambda: KeepBest(1, ""), r"KeepBest: metric must be the non-empty name .* got ''"),
        (lambda: KeepBest(1, "loss", "lowest"), r"KeepBest: mode must be 'min' or 'max'"),  # type: ignore[arg-type]
        (lambda: KeepEveryNSteps(0), r"KeepEveryNSteps: n must be a positive number, got 0"),
        (lambda: KeepAny(), r"KeepAny: give at least one retention policy"),
        (lambda: SaveEveryNSteps(0), r"SaveEveryNSteps: n must be an int >= 1 .* got 0"),
        (lambda: SaveEveryNSteps(2.0), r"SaveEveryNSteps: n must be an int >= 1 .* got 2\.0"),  # type: ignore[arg-type]
        (lambda: SaveEveryNSeconds(float("inf")), r"SaveEveryNSeconds: seconds .* got inf"),
        (lambda: SaveEveryNSeconds(-1), r"SaveEveryNSeconds: seconds .* got -1"),
        (lambda: SaveAny(), r"SaveAny: give at least one save policy"),
    ],
)
def test_policies_are_validated_when_built(build, message, without_type_checks):
    with pytest.raises(ValueError, match=message):
        build()


def test_a_combination_refuses_a_member_that_is_not_a_policy(without_type_checks):
    with pytest.raises(TypeError, match="KeepAny: every member must be a retention policy"):
        KeepAny(KeepLatest(1), 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="SaveAny: every member must be a save policy"):
        SaveAny(SaveOnPreemption(), KeepLatest(1))  # type: ignore[arg-type]


def test_policies_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        KeepLatest(2).n = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        SaveEveryNSteps(2).n = 3  # type: ignore[misc]


# ---------------------------------------------------------------- save policies


def _asked(step, seconds=0.0, preempted=False):
    return SaveContext(Decimal(step), seconds, preempted)


def test_save_every_n_steps_says_yes_at_its_multiples():
    policy = SaveEveryNSteps(3)
    assert [s for s in range(10) if policy.should_save(_asked(s))] == [0, 3, 6, 9]
    assert not policy.should_save(_asked("4.5"))


def test_save_every_n_seconds_says_yes_once_they_have_passed():
    policy = SaveEveryNSeconds(60)
    assert not policy.should_save(_asked(1, seconds=59.9))
    assert policy.should_save(_asked(1, seconds=60.0))


def test_save_on_preemption_and_any_combine():
    policy = SaveAny(SaveOnPreemption(), SaveEveryNSteps(10))
    assert policy.should_save(_asked(10))
    assert policy.should_save(_asked(7, preempted=True))
    assert not policy.should_save(_asked(7))
    assert isinstance(policy, SavePolicy)


# ---------------------------------------------------------------- the manager


def test_the_shorthands_build_the_documented_policies(tmp_path):
    manager = CheckpointManager(
        tmp_path,
        keep_latest=2,
        keep_best=1,
        best_metric="loss",
        keep_every_n_steps=100,
        save_interval_steps=10,
        save_interval_seconds=60,
    )
    assert manager.retention == KeepAny(KeepLatest(2), KeepEveryNSteps(100), KeepBest(1, "loss"))
    assert manager.save_policy == SaveAny(
        SaveOnPreemption(), SaveEveryNSteps(10), SaveEveryNSeconds(60)
    )
    default = CheckpointManager(tmp_path / "default")
    assert default.retention == KeepLatest(1) and default.keep_latest == 1
    assert default.save_policy == SaveOnPreemption()


def test_a_retention_policy_keeps_what_the_shorthands_keep(tmp_path):
    policy = KeepAny(KeepLatest(2), KeepBest(1, "loss"))
    manager = CheckpointManager(tmp_path, retention=policy)
    for step, loss in {1: 0.9, 2: 0.2, 3: 0.5, 4: 0.7, 5: 0.6}.items():
        manager.save(step, _state(step), metrics={"loss": loss})
    assert manager.all_steps() == [2, 4, 5]
    # "best" is the metric the policy ranks by, with no best_metric given.
    assert manager.best_metric == "loss" and manager.best_step() == 2
    np.testing.assert_array_equal(manager.restore(_state(0), step="best")["w"], _state(2)["w"])


def test_the_checkpoint_just_saved_is_never_deleted_whatever_the_policy(tmp_path):
    manager = CheckpointManager(tmp_path, retention=KeepBest(1, "loss"))
    for step, loss in {1: 0.1, 2: 0.5, 3: 0.9}.items():
        manager.save(step, _state(step), metrics={"loss": loss})
        assert manager.latest_step() == step
    assert manager.all_steps() == [1, 3]


def test_two_best_metrics_read_each_checkpoint_once_per_retention(tmp_path, monkeypatch):
    policy = KeepAny(KeepLatest(1), KeepBest(1, "loss"), KeepBest(1, "acc", mode="max"))
    manager = CheckpointManager(tmp_path, retention=policy)
    reads: list[str] = []
    real = _retention.metadata_of

    def counting(store, entry):
        reads.append(entry.text)
        return real(store, entry)

    monkeypatch.setattr(_retention, "metadata_of", counting)
    rows = {1: (0.1, 0.5), 2: (0.5, 0.9), 3: (0.7, 0.1), 4: (0.9, 0.2)}
    for step, (loss, acc) in rows.items():
        manager.save(step, _state(step), metrics={"loss": loss, "acc": acc})
    assert manager.all_steps() == [1, 2, 4]  # best loss, best acc, the newest
    assert sorted(reads) == sorted(["1", "2", "1", "2", "3", "1", "2", "3", "4"])
    assert manager.best_metric is None  # two metrics: "best" is not guessed


def test_a_save_policy_decides_should_save(tmp_path, monkeypatch):
    now = [0.0]
    monkeypatch.setattr(_manager, "_clock", lambda: now[0])
    manager = CheckpointManager(
        tmp_path, save_policy=SaveAny(SaveEveryNSeconds(60)), handle_sigterm=False
    )
    assert not manager.should_save(0)  # no step interval: step 0 is not special
    now[0] = 60.0
    assert manager.should_save(1)
    manager.save(1, _state(1))
    now[0] = 100.0
    assert not manager.should_save(2)


def test_without_save_on_preemption_a_preemption_is_seen_but_not_saved(tmp_path, monkeypatch):
    monkeypatch.setattr(_coordination, "reached_preemption", lambda step: step == 3)
    manager = CheckpointManager(tmp_path, save_policy=SaveEveryNSteps(2), handle_sigterm=False)
    assert [manager.should_save(s) for s in range(3)] == [True, False, True]
    assert not manager.should_save(3) and manager.preempted


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"retention": KeepLatest(2), "keep_latest": 3}, "retention= and keep_latest= both"),
        ({"retention": KeepLatest(2), "keep_best": 1}, "retention= and keep_best= both"),
        (
            {"retention": KeepLatest(2), "keep_every_n_steps": 10},
            "retention= and keep_every_n_steps= both",
        ),
        (
            {"save_policy": SaveEveryNSteps(5), "save_interval_steps": 5},
            "save_policy= and save_interval_steps= both",
        ),
        (
            {"save_policy": SaveOnPreemption(), "save_interval_seconds": 60},
            "save_policy= and save_interval_seconds= both",
        ),
    ],
)
def test_a_shorthand_and_a_policy_for_the_same_thing_are_refused(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        CheckpointManager(tmp_path, **kwargs)


def test_a_policy_that_is_not_one_is_refused_naming_it(tmp_path, without_type_checks):
    with pytest.raises(TypeError, match="retention must be a retention policy .* got 3"):
        CheckpointManager(tmp_path, retention=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="save_policy must be a save policy .* got 'often'"):
        CheckpointManager(tmp_path, save_policy="often")  # type: ignore[arg-type]


def test_the_managers_options_are_read_only(tmp_path):
    manager = CheckpointManager(tmp_path, keep_latest=3)
    assert manager.keep_latest == 3 and manager.prefix == "checkpoint_"
    with pytest.raises(AttributeError, match="keep_latest is read-only"):
        manager.keep_latest = 5  # type: ignore[misc]
