"""The command line: `python -m eqx_train inspect|verify|diff` on every layout, and errors."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_train._cli import main
from eqx_train.checkpoints import (
    CheckpointManager,
    save_checkpoint,
    save_checkpoint_multiprocess,
)
from eqx_train.interop import save_sharded


def _tree(kernel=1.0):
    return {
        "params": {
            "dense": {
                "kernel": np.full((3, 4), kernel, np.float32),
                "bias": jnp.zeros(4, jnp.bfloat16),
            }
        },
        "count": 3,
    }


@pytest.fixture(params=["file", "shards", "hf"])
def layout(request, tmp_path):
    """A checkpoint of `_tree()` in each layout, and its path."""
    if request.param == "file":
        return save_checkpoint(tmp_path / "ck", _tree(), 7)
    if request.param == "shards":
        return save_checkpoint_multiprocess(tmp_path / "ck", _tree(), 7)
    save_sharded(tmp_path / "hf", _tree(), max_shard_size=20)
    return str(tmp_path / "hf")


def test_inspect_shows_step_and_a_tree_of_names_shapes_dtypes_sizes(layout, capsys):
    assert main(["inspect", layout]) == 0
    out = capsys.readouterr().out
    if not layout.endswith("hf"):
        assert "step: 7" in out
    lines = [line.split() for line in out.splitlines()]
    assert ["params"] in lines and ["dense"] in lines
    assert ["kernel", "float32[3,", "4]", "48", "B"] in lines
    assert ["bias", "bfloat16[4]", "8", "B"] in lines
    assert ["count", "int64[]", "8", "B"] in lines


def test_inspect_shows_metrics_and_metadata(tmp_path, capsys):
    with CheckpointManager(tmp_path) as manager:
        path = manager.save(2, _tree(), metrics={"loss": 0.5}, metadata={"lr": 0.1})
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert 'metrics: {"loss": 0.5}' in out and 'metadata: {"lr": 0.1}' in out


def test_inspect_of_a_checkpoint_directory_lists_its_steps(tmp_path, capsys):
    for step in (2, 10, 20):
        save_checkpoint(tmp_path, _tree(), step, keep=5)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    steps = [line.split()[1] for line in out.splitlines() if line.strip().startswith("step")]
    assert steps == ["2", "10", "20"]


def _directory_with_metrics(tmp_path):
    with CheckpointManager(tmp_path, keep_latest=5) as manager:
        for step, loss in ((1, 0.5), (2, 0.25), (3, 0.4)):
            manager.save(step, _tree(), metrics={"loss": loss})
    return str(tmp_path)


def test_inspect_of_a_directory_shows_metrics_and_marks_the_lowest_as_best(tmp_path, capsys):
    assert main(["inspect", _directory_with_metrics(tmp_path)]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["step", "1", "file", "checkpoint_1.safetensors", "loss=0.5"] in lines
    assert ["*", "step", "2", "file", "checkpoint_2.safetensors", "loss=0.25"] in lines
    assert ["*", "best", "by", "'loss'", "(min):", "step", "2"] in lines


def test_inspect_of_a_directory_ranks_by_best_metric_and_mode(tmp_path, capsys):
    path = _directory_with_metrics(tmp_path)
    assert main(["inspect", path, "--best-metric", "loss", "--mode", "max"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["*", "step", "1", "file", "checkpoint_1.safetensors", "loss=0.5"] in lines
    assert ["*", "best", "by", "'loss'", "(max):", "step", "1"] in lines


def test_inspect_shows_a_typed_keys_implementation(tmp_path, capsys):
    path = save_checkpoint(tmp_path, {"rng": jax.random.key(0, impl="rbg")}, 1)
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "typed PRNG keys:\n  rng  rbg\n" in out


def test_verify_passes_good_checkpoints(layout, capsys):
    assert main(["verify", layout]) == 0
    assert ": ok" in capsys.readouterr().out


def _corrupt_last_byte(path):
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 0xFF]))


def _data_files(path):
    if os.path.isfile(path):
        return [path]
    return sorted(
        os.path.join(path, f)
        for f in os.listdir(path)
        if f.endswith(".safetensors") and f != "index.safetensors"
    )


def test_verify_reports_each_corrupt_tensor_on_one_line_and_fails(layout, capsys):
    victim = _data_files(layout)[-1]
    _corrupt_last_byte(victim)
    assert main(["verify", layout]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert os.path.basename(victim) in err[0] and "checksum" in err[0]


def test_verify_of_a_directory_checks_every_checkpoint(tmp_path, capsys):
    save_checkpoint(tmp_path, _tree(), 1, keep=2)
    bad = save_checkpoint(tmp_path, _tree(), 2, keep=2)
    _corrupt_last_byte(bad)
    assert main(["verify", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "checkpoint_1.safetensors: ok" in captured.out
    assert "checkpoint_2.safetensors" in captured.err


def test_diff_of_identical_checkpoints_in_different_layouts_is_zero(layout, tmp_path, capsys):
    other = save_checkpoint(tmp_path / "other", _tree(), 1)
    assert main(["diff", layout, other]) == 0
    assert "identical" in capsys.readouterr().out


def test_diff_names_missing_mismatched_and_changed_leaves(tmp_path, capsys):
    a = _tree()
    b = _tree(kernel=1.0)
    b["params"]["dense"]["kernel"][0, :2] = [1.25, -2.0]
    b["params"]["dense"]["bias"] = jnp.zeros(5, jnp.bfloat16)
    del b["count"]
    b["extra"] = np.zeros(1)
    path_a = save_checkpoint(tmp_path / "a", a, 1)
    save_sharded(tmp_path / "b", b)
    assert main(["diff", path_a, str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out
    assert "only in A: count int64[]" in out
    assert "only in B: extra float64[1]" in out
    assert "differs: params.dense.bias A bfloat16[4], B bfloat16[5]" in out
    assert "differs: params.dense.kernel float32[3, 4]: 2 of 12 elements, max abs diff 3" in out


def test_diff_counts_signed_zero_and_nan_like_bits(tmp_path, capsys):
    a = {"x": np.array([0.0, np.nan, 1.0], np.float32)}
    b = {"x": np.array([-0.0, np.nan, 1.0], np.float32)}
    pa, pb = save_checkpoint(tmp_path / "a", a, 1), save_checkpoint(tmp_path / "b", b, 1)
    assert main(["diff", pa, pb]) == 1
    assert "1 of 3 elements" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["inspect", "verify", "diff"])
def test_a_missing_path_is_one_line_naming_it_exit_1(tmp_path, capsys, command):
    missing = str(tmp_path / "nope.safetensors")
    extra = [save_checkpoint(tmp_path, _tree(), 1)] if command == "diff" else []
    assert main([command, *extra, missing]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope.safetensors" in err[0]


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_corrupt_header_is_one_line_naming_the_file_exit_1(tmp_path, capsys, command):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"\xff" * 40)
    assert main([command, str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "junk.safetensors" in err[0]


def test_a_hostile_hf_index_is_one_line_naming_it(tmp_path, capsys):
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"w": "../x"}}')
    assert main(["inspect", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.safetensors.index.json" in err[0]


def test_usage_errors_exit_2():
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


def test_inspect_in_a_subprocess_never_starts_a_jax_backend(tmp_path):
    path = save_checkpoint(tmp_path, _tree(), 3)
    script = (
        "import sys\n"
        "from eqx_train._cli import main\n"
        "code = main(['inspect', sys.argv[1]])\n"
        "from jax._src import xla_bridge\n"
        "assert not xla_bridge.backends_are_initialized(), 'a JAX backend was started'\n"
        "sys.exit(code)\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", script, path], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "step: 3" in result.stdout


def test_python_dash_m_runs_the_command_line(tmp_path):
    path = save_checkpoint(tmp_path, _tree(), 3)
    result = subprocess.run(
        [sys.executable, "-m", "eqx_train", "inspect", path],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0 and "step: 3" in result.stdout


@pytest.mark.parametrize("tensors", [1, 2000])
def test_inspect_into_a_pipe_closed_early_ends_quietly(tmp_path, tensors):
    """`eqx-train inspect ... | head`: the reader is gone before (a small listing) or while
    (a long one) the command writes; nothing on stderr, status 141 as for `cat`."""
    path = save_checkpoint(tmp_path, {f"w{i}": np.zeros(1, np.float32) for i in range(tensors)}, 3)
    read_end, write_end = os.pipe()
    os.close(read_end)  # `head` has read its lines and exited
    try:
        result = subprocess.run(
            [sys.executable, "-m", "eqx_train", "inspect", path],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
    finally:
        os.close(write_end)
    assert result.stderr == "" and result.returncode == 141


def test_inspect_piped_into_head_prints_its_first_lines_only(tmp_path):
    path = save_checkpoint(tmp_path, {f"w{i}": np.zeros(1, np.float32) for i in range(2000)}, 3)
    command = f"{sys.executable} -m eqx_train inspect {path} | head -n 2"
    result = subprocess.run(
        ["bash", "-c", command + "; echo status ${PIPESTATUS[0]} >&2"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.stdout.count("\n") == 2 and "step: 3" in result.stdout
    assert result.stderr in ("status 141\n", "status 0\n")


def test_inspect_refuses_ranking_options_where_there_is_no_listing_to_rank(tmp_path, capsys):
    path = save_checkpoint(tmp_path, _tree(), 3)
    for argv in (
        ["inspect", path, "--best-metric", "loss"],
        ["inspect", str(tmp_path), "--tree", "--mode", "max"],
    ):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "only a directory's listing of checkpoints is ranked" in err
    assert main(["inspect", str(tmp_path), "--mode", "max"]) == 0
