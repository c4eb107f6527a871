"""The command line and foreign checkpoints: `convert-orbax`; `inspect`, `verify`, `diff` and
`convert-flax` on Orbax directories and flax msgpack files; `diff --atol/--rtol`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from eqx_train._cli import main
from eqx_train.checkpoints import available_steps, restore_checkpoint, save_checkpoint
from eqx_train.interop import load_orbax_checkpoint
from tests.support.helpers import assert_trees_equal

ocp = pytest.importorskip("orbax.checkpoint")


def _state(scale: float) -> dict:
    return {
        "params": {
            "dense": {"kernel": jnp.full((3, 4), float(scale)), "bias": jnp.ones(4, jnp.bfloat16)}
        },
        "step": jnp.int32(scale),
    }


@pytest.fixture
def flax_orbax_run(tmp_path):
    """A run directory of flax's default (Orbax) checkpoints at steps 1 and 2."""
    from flax.training import checkpoints

    run = tmp_path / "flax_run"
    for step in (1, 2):
        checkpoints.save_checkpoint(run, _state(step), step=step, keep=5)
    return run


@pytest.fixture
def manager_step(tmp_path):
    """A CheckpointManager run with one step (3) of two items, `state` and `extra`."""
    run = tmp_path / "manager_run"
    with ocp.CheckpointManager(run) as manager:
        manager.save(
            3,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(_state(3)),
                extra=ocp.args.StandardSave({"position": jnp.arange(5)}),
            ),
        )
    return run


@pytest.fixture
def flax_msgpack_file(tmp_path):
    import flax
    from flax.training import checkpoints

    before = flax.config.flax_use_orbax_checkpointing
    flax.config.update("flax_use_orbax_checkpointing", False)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Flax Checkpointing will soon be deprecated")
            return checkpoints.save_checkpoint(tmp_path / "msgpack_run", _state(4), step=4)
    finally:
        flax.config.update("flax_use_orbax_checkpointing", before)


# --------------------------------------------------------------------------- convert-orbax


def test_convert_orbax_keeps_every_step_bit_for_bit(flax_orbax_run, tmp_path, capsys):
    dst = tmp_path / "eqx_run"
    assert main(["convert-orbax", str(flax_orbax_run), str(dst)]) == 0
    assert available_steps(dst) == [1, 2]
    for step in (1, 2):
        source = flax_orbax_run / f"checkpoint_{step}"
        assert_trees_equal(restore_checkpoint(dst, None, step=step), load_orbax_checkpoint(source))
        assert f"{source} -> " in capsys.readouterr().out or step == 2


def test_convert_orbax_of_an_item_named_like_a_step_takes_its_step_directorys_number(tmp_path):
    run = tmp_path / "manager_run"
    with ocp.CheckpointManager(run) as manager:
        manager.save(100, args=ocp.args.Composite(ema_2=ocp.args.StandardSave(_state(1))))
    dst = tmp_path / "dst"
    assert main(["convert-orbax", str(run / "100" / "ema_2"), str(dst)]) == 0
    assert available_steps(dst) == [100]


def test_convert_orbax_of_a_manager_step_takes_the_item_and_the_step(manager_step, tmp_path):
    dst = tmp_path / "eqx_run"
    assert main(["convert-orbax", str(manager_step / "3"), str(dst), "--item", "extra"]) == 0
    assert available_steps(dst) == [3]
    assert_trees_equal(restore_checkpoint(dst, None), {"position": np.arange(5, dtype=np.int32)})
    # The item's own directory: its step is its step directory's name.
    other = tmp_path / "other"
    assert main(["convert-orbax", str(manager_step / "3" / "state"), str(other)]) == 0
    assert available_steps(other) == [3]


def test_convert_orbax_without_item_on_two_items_is_one_line_listing_them(
    manager_step, tmp_path, capsys
):
    assert main(["convert-orbax", str(manager_step), str(tmp_path / "dst")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "several items (extra, state)" in err
    assert not os.path.exists(tmp_path / "dst")


def test_convert_orbax_of_a_checkpoint_named_without_a_step_refuses_to_guess_one(tmp_path, capsys):
    """NNX's guide saves `StandardCheckpointer().save(dir / "state", ...)`: no step in any
    name, none in Orbax's metadata."""
    source = tmp_path / "state"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(source, _state(5))
    dst = tmp_path / "dst"
    assert main(["convert-orbax", str(source), str(dst)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("pass the step to save it as with --step N\n")
    assert not os.path.exists(dst)
    assert main(["convert-orbax", str(source), str(dst), "--step", "5"]) == 0
    assert available_steps(dst) == [5]


def test_convert_orbax_takes_step_zero_only_where_a_name_says_it(tmp_path):
    from flax.training import checkpoints

    checkpoints.save_checkpoint(tmp_path / "run", _state(0), step=0)
    assert main(["convert-orbax", str(tmp_path / "run" / "checkpoint_0"), str(tmp_path / "a")]) == 0
    assert available_steps(tmp_path / "a") == [0]


def test_convert_orbax_step_names_one_checkpoint_not_a_run(flax_orbax_run, tmp_path, capsys):
    assert main(["convert-orbax", str(flax_orbax_run), str(tmp_path / "dst"), "--step", "9"]) == 1
    err = capsys.readouterr().err
    assert "directory of Orbax steps (2), each converted as its own step" in err
    assert not os.path.exists(tmp_path / "dst")


def test_convert_orbax_item_messages_name_the_command_once_and_speak_flags(
    manager_step, flax_orbax_run, tmp_path, capsys
):
    dst = str(tmp_path / "dst")
    assert main(["convert-orbax", str(manager_step), dst]) == 1
    assert capsys.readouterr().err == (
        f"eqx-train convert-orbax: {manager_step / '3'} holds several items (extra, state); "
        "choose one with --item NAME\n"
    )
    assert main(["convert-orbax", str(manager_step / "3"), dst, "--item", "ema"]) == 1
    assert capsys.readouterr().err == (
        f"eqx-train convert-orbax: {manager_step / '3'} has no item 'ema'; its items are "
        "extra, state: choose one with --item NAME\n"
    )
    assert main(["convert-orbax", str(flax_orbax_run / "checkpoint_1"), dst, "--item", "x"]) == 1
    err = capsys.readouterr().err
    assert err.count("convert-orbax") == 1 and err.endswith("leave out --item x\n")
    assert not os.path.exists(dst)


def test_convert_orbax_never_deletes_what_the_destination_holds(flax_orbax_run, tmp_path, capsys):
    dst = tmp_path / "eqx_run"
    save_checkpoint(dst, {"x": np.zeros(2)}, 0)
    assert main(["convert-orbax", str(flax_orbax_run), str(dst)]) == 0
    assert available_steps(dst) == [0, 1, 2]
    # Steps not newer than what DST holds are refused before anything is written.
    save_checkpoint(dst, {"x": np.ones(2)}, 7, keep=100)
    assert main(["convert-orbax", str(flax_orbax_run), str(dst)]) == 1
    assert "already holds step 7; the steps to convert (1, 2)" in capsys.readouterr().err
    assert available_steps(dst) == [0, 1, 2, 7]


def test_convert_orbax_of_something_else_is_one_line_naming_it(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    assert main(["convert-orbax", str(tmp_path / "notes"), str(tmp_path / "dst")]) == 1
    err = capsys.readouterr().err
    assert "is not an Orbax checkpoint" in err and str(tmp_path / "notes") in err
    assert main(["convert-orbax", str(tmp_path / "nope"), str(tmp_path / "dst")]) == 1
    assert "nope: no such file or directory" in capsys.readouterr().err


# ------------------------------------------------------------- Orbax seen by other commands


@pytest.mark.parametrize("command", ["verify", "convert-flax", "diff"])
def test_commands_recognise_an_orbax_directory_and_name_the_command_that_reads_it(
    flax_orbax_run, tmp_path, capsys, command
):
    for path in (flax_orbax_run, flax_orbax_run / "checkpoint_2"):
        argv = [command, str(path)]
        argv += [str(path)] if command == "diff" else []
        argv += [str(tmp_path / "dst")] if command == "convert-flax" else []
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert "Orbax" in err and f"eqx-train convert-orbax {path} DST" in err
        assert "no checkpoint" not in err and "no flax checkpoint" not in err


def _assert_lists_kernel_and_bias(out):
    lines = [line.split() for line in out.splitlines()]
    assert ["kernel", "float32[3,", "4]", "48", "B"] in lines
    assert ["bias", "bfloat16[4]", "8", "B"] in lines


def test_inspect_of_an_orbax_checkpoint_lists_its_arrays(flax_orbax_run, capsys):
    path = flax_orbax_run / "checkpoint_2"
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{path}: an Orbax PyTree checkpoint" in out
    _assert_lists_kernel_and_bias(out)
    assert f"eqx-train convert-orbax {path} DST" in out


def test_inspect_of_an_orbax_run_and_a_manager_step(flax_orbax_run, manager_step, capsys):
    assert main(["inspect", str(flax_orbax_run)]) == 0
    out = capsys.readouterr().out
    assert "a directory of 2 Orbax checkpoints" in out and "checkpoint_1" in out
    assert f"latest: {flax_orbax_run / 'checkpoint_2'}" in out
    assert main(["inspect", str(manager_step / "3")]) == 0
    out = capsys.readouterr().out
    assert "CheckpointManager step with items extra, state" in out
    assert "item extra: 1 arrays, 20 B" in out and "item state: 3 arrays" in out


def test_inspect_tree_of_orbax_lists_every_full_name_under_its_prefixes(
    flax_orbax_run, manager_step, capsys
):
    assert main(["inspect", "--tree", str(flax_orbax_run / "checkpoint_2")]) == 0
    out = capsys.readouterr().out
    assert "tensors by name prefix" in out and re.search(r"params\.dense +2 tensors", out)
    assert re.search(r"\n {6}params\.dense\.kernel +float32\[3, 4\]", out)
    assert main(["inspect", "--tree", str(manager_step / "3")]) == 0
    out = capsys.readouterr().out
    assert "item extra: 1 arrays" in out and re.search(r"\n  position +int32\[5\]", out)
    assert re.search(r"params\.dense\.bias +bfloat16\[4\]", out)


# ------------------------------------------------------------------------ flax msgpack files


def test_inspect_opens_a_flax_msgpack_file(flax_msgpack_file, capsys):
    assert main(["inspect", flax_msgpack_file]) == 0
    out = capsys.readouterr().out
    assert f"{flax_msgpack_file}: flax msgpack checkpoint, 3 tensors" in out
    _assert_lists_kernel_and_bias(out)
    assert f"eqx-train convert-flax {flax_msgpack_file} DST" in out
    assert main(["inspect", os.path.dirname(flax_msgpack_file)]) == 0
    out = capsys.readouterr().out
    assert "a directory of 1 flax msgpack checkpoints" in out and "checkpoint_4" in out


@pytest.mark.parametrize("command", ["verify", "diff"])
def test_verify_and_diff_name_a_flax_msgpack_file_and_its_converter(
    flax_msgpack_file, capsys, command
):
    argv = [command, flax_msgpack_file] + ([flax_msgpack_file] if command == "diff" else [])
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "is a flax msgpack checkpoint" in err and "eqx-train convert-flax" in err


# ------------------------------------------------------------------------ diff --atol/--rtol


def _pair(tmp_path, a: dict, b: dict) -> tuple[str, str]:
    return save_checkpoint(tmp_path / "a", a, 1), save_checkpoint(tmp_path / "b", b, 1)


def test_diff_atol_accepts_float_differences_within_it(tmp_path, capsys):
    a, b = _pair(
        tmp_path,
        {"w": np.array([1.0, 2.0, 3.0], np.float32)},
        {"w": np.array([1.0, 2.001, 3.0], np.float32)},
    )
    assert main(["diff", a, b]) == 1
    assert "1 of 3 elements, max abs diff 0.000999" in capsys.readouterr().out
    assert main(["diff", a, b, "--atol", "0.01"]) == 0
    assert "1 of 1 tensors equal within atol=0.01, rtol=0; A and B match" in (
        capsys.readouterr().out
    )
    assert main(["diff", a, b, "--atol", "0.0001"]) == 1
    assert "1 of 3 elements beyond atol=0.0001, rtol=0" in capsys.readouterr().out


def test_diff_rtol_scales_with_the_magnitude_of_b(tmp_path, capsys):
    a, b = _pair(
        tmp_path,
        {"w": np.array([1000.5, 1.5], np.float64)},
        {"w": np.array([1000.0, 1.0], np.float64)},
    )
    # 0.5 <= 1e-3 * 1000 for the first element, not for the second.
    assert main(["diff", a, b, "--rtol", "1e-3"]) == 1
    assert "1 of 2 elements beyond atol=0, rtol=0.001" in capsys.readouterr().out
    assert main(["diff", a, b, "--rtol", "1e-3", "--atol", "0.5"]) == 0


def test_diff_tolerance_never_applies_to_integers_and_keeps_nan_and_inf_exact(tmp_path, capsys):
    a, b = _pair(
        tmp_path,
        {"i": np.array([1, 2], np.int32), "f": np.array([np.nan, np.inf, -np.inf], np.float32)},
        {"i": np.array([1, 3], np.int32), "f": np.array([np.nan, np.inf, np.inf], np.float32)},
    )
    assert main(["diff", a, b, "--atol", "10"]) == 1
    out = capsys.readouterr().out
    assert "differs: i int32[2]: 1 of 2 elements" in out
    assert "differs: f float32[3]: 1 of 3 elements" in out  # -inf vs inf only


def test_diff_tolerance_compares_bfloat16_by_value(tmp_path, capsys):
    a, b = _pair(
        tmp_path,
        {"h": jnp.array([1.0, 2.0], jnp.bfloat16)},
        {"h": jnp.array([1.0, 2.015625], jnp.bfloat16)},  # the next bfloat16 after 2
    )
    assert main(["diff", a, b]) == 1
    assert "max abs diff 0.015625" in capsys.readouterr().out
    assert main(["diff", a, b, "--atol", "0.02"]) == 0
    assert main(["diff", a, b, "--rtol", "0.001"]) == 1


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "abc"])
def test_diff_refuses_a_tolerance_that_is_not_a_finite_non_negative_number(tmp_path, value):
    a, b = _pair(tmp_path, {"w": np.zeros(1)}, {"w": np.zeros(1)})
    with pytest.raises(SystemExit) as raised:
        main(["diff", a, b, "--atol", value])
    assert raised.value.code == 2


def test_inspect_of_orbax_and_flax_imports_neither_jax_nor_orbax(flax_orbax_run, flax_msgpack_file):
    script = (
        "import sys\n"
        "from eqx_train._cli import main\n"
        "codes = [main(['inspect', path]) for path in sys.argv[1:]]\n"
        "assert 'jax' not in sys.modules and 'orbax' not in sys.modules, 'imported'\n"
        "sys.exit(max(codes))\n"
    )
    paths = [str(flax_orbax_run / "checkpoint_1"), flax_msgpack_file]
    result = subprocess.run(
        [sys.executable, "-c", script, *paths], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "an Orbax PyTree checkpoint" in result.stdout and "flax msgpack" in result.stdout


def test_convert_orbax_without_tensorstore_names_the_extra(
    flax_orbax_run, tmp_path, capsys, monkeypatch
):
    monkeypatch.setitem(sys.modules, "tensorstore", None)
    assert main(["convert-orbax", str(flax_orbax_run), str(tmp_path / "dst")]) == 1
    assert "pip install 'eqx_train[orbax]'" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "dst")


def test_diff_relative_tolerance_holds_a_finite_value_apart_from_an_infinity(tmp_path, capsys):
    """|1e308 - inf| <= 1 * |inf| holds, yet an infinity equals only itself."""
    a, b = _pair(tmp_path, {"f": np.array([1e308, 1.0])}, {"f": np.array([np.inf, 1.0])})
    assert main(["diff", a, b, "--rtol", "1"]) == 1
    assert "differs: f float64[2]: 1 of 2 elements" in capsys.readouterr().out


def test_diff_tolerance_compares_a_complex_with_a_nan_part_part_by_part(tmp_path, capsys):
    """As assert_trees_equal does: NaN equals NaN in the same part, the other part is
    within the tolerance or not."""
    nan = float("nan")
    a, b = _pair(
        tmp_path,
        {"z": np.array([complex(nan, 1.0), complex(nan, 1.0), complex(nan, 1.0)])},
        {"z": np.array([complex(nan, 1.25), complex(nan, 100.0), complex(1.0, nan)])},
    )
    assert main(["diff", a, b, "--atol", "0.5"]) == 1
    assert "differs: z complex128[3]: 2 of 3 elements" in capsys.readouterr().out


def test_inspect_tree_of_flax_msgpack_lists_full_names_of_a_file_and_a_directorys_latest(
    flax_msgpack_file, capsys
):
    for path in (flax_msgpack_file, os.path.dirname(flax_msgpack_file)):
        assert main(["inspect", "--tree", path]) == 0
        out = capsys.readouterr().out
        assert "tensors by name prefix" in out
        assert re.search(r"params\.dense\.kernel +float32\[3, 4\]", out)
        assert f"{flax_msgpack_file}: flax msgpack checkpoint, 3 tensors" in out
