"""load_orbax_checkpoint and `eqx-train inspect` against hostile Orbax directories: what a
tiny file declares must never make the reader allocate without bound or abort."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from eqx_train.checkpoints import CheckpointFormatError
from eqx_train.interop import load_orbax_checkpoint

ocp = pytest.importorskip("orbax.checkpoint")


def _plain_checkpoint(tmp_path):
    path = tmp_path / "plain"
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)).save(path, {"w": np.arange(3.0)})
    return path, json.loads((path / "w" / ".zarray").read_text())


def test_a_tiny_array_declaring_a_huge_chunk_is_refused_without_aborting(tmp_path):
    # tensorstore decodes a chunk whole: a 3-element array with a 64 GiB chunk made it
    # throw std::bad_alloc and abort the process. Run where an abort cannot take pytest down,
    # with an address-space limit so nothing else on the machine pays for it.
    path, zarray = _plain_checkpoint(tmp_path)
    (path / "w" / ".zarray").write_text(json.dumps({**zarray, "chunks": [2**33]}))
    script = textwrap.dedent(
        f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))
        from eqx_train.checkpoints import CheckpointFormatError
        from eqx_train.interop import load_orbax_checkpoint
        try:
            load_orbax_checkpoint({str(path)!r})
        except CheckpointFormatError as error:
            print(error)
            sys.exit(0)
        sys.exit(3)
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "declares chunks of shape (8589934592,)" in done.stdout
    assert str(path) in done.stdout


def test_a_chunk_larger_than_a_small_array_but_under_a_mebibyte_is_not_refused_as_hostile(tmp_path):
    path, zarray = _plain_checkpoint(tmp_path)
    (path / "w" / ".zarray").write_text(json.dumps({**zarray, "chunks": [1024]}))
    # The data was written as one chunk of 3: with chunks of 1024 it no longer decodes,
    # but opening (where chunks are checked) passes and the read names the array.
    with pytest.raises(CheckpointFormatError, match="array 'w' cannot be read"):
        load_orbax_checkpoint(path)


def test_metadata_larger_than_64_mib_is_refused_before_it_is_parsed(tmp_path):
    # JSON parses to ~20x its size in Python objects: the size bound is the memory bound.
    path, _ = _plain_checkpoint(tmp_path)
    with open(path / "_METADATA", "w") as f:
        f.write('{"tree_metadata": {}}')
        f.write(" " * (64 << 20))
    with pytest.raises(CheckpointFormatError, match=r"has \d+ bytes, more than 67108864"):
        load_orbax_checkpoint(path)


# ------------------------------------------------------------------------------ diff


def _diff_pair(tmp_path, a: dict, b: dict) -> tuple[str, str]:
    from eqx_train.checkpoints import save_checkpoint

    return save_checkpoint(tmp_path / "a", a, 1), save_checkpoint(tmp_path / "b", b, 1)


@pytest.mark.parametrize(
    "dtype, low, high",
    [(np.uint64, 2**64 - 2, 2**64 - 1), (np.int64, 2**62, 2**62 + 1), (np.int64, -(2**63), 2**62)],
)
def test_diff_reports_the_exact_gap_of_64_bit_integers(tmp_path, capsys, dtype, low, high):
    from eqx_train._cli import main

    a, b = _diff_pair(tmp_path, {"w": np.array([low], dtype)}, {"w": np.array([high], dtype)})
    assert main(["diff", a, b]) == 1
    assert f"1 of 1 elements, max abs diff {float(high - low):.6g}\n" in capsys.readouterr().out


def test_diff_of_floats_whose_difference_overflows_reports_inf_without_a_warning(tmp_path, capsys):
    # pytest runs with warnings as errors: a RuntimeWarning here fails the test.
    from eqx_train._cli import main

    a, b = _diff_pair(tmp_path, {"w": np.array([1.7e308])}, {"w": np.array([-1.7e308])})
    for tolerance in ([], ["--atol", "1"]):
        assert main(["diff", a, b, *tolerance]) == 1
        assert "1 of 1 elements" in (out := capsys.readouterr().out)
        assert "max abs diff inf" in out


def test_diff_with_a_tolerance_of_empty_and_mismatched_arrays(tmp_path, capsys):
    from eqx_train._cli import main

    a, b = _diff_pair(
        tmp_path,
        {"e": np.zeros((0, 3), np.float32), "s": np.zeros(3, np.float32), "d": np.zeros(2)},
        {"e": np.zeros((0, 3), np.float32), "s": np.zeros(4, np.float32), "d": np.zeros(2, "f4")},
    )
    assert main(["diff", a, b, "--atol", "1"]) == 1
    out = capsys.readouterr().out
    assert "differs: s A float32[3], B float32[4]" in out
    assert "differs: d A float64[2], B float32[2]" in out
    assert "1 of 3 tensors equal within atol=1, rtol=0\n" in out


# ------------------------------------------------------------------------------ files


def _load_in_subprocess(path) -> str:
    """load_orbax_checkpoint(path) in a child with a deadline: a reader that blocks forever
    fails the test instead of hanging the suite. Returns the error it printed."""
    script = textwrap.dedent(
        f"""
        from eqx_train.checkpoints import CheckpointFormatError
        from eqx_train.interop import load_orbax_checkpoint
        try:
            load_orbax_checkpoint({str(path)!r})
        except CheckpointFormatError as error:
            print(error)
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _ocdbt_checkpoint(tmp_path):
    path = tmp_path / "ocdbt"
    ocp.PyTreeCheckpointer().save(path, {"w": np.arange(3.0)})
    return path


@pytest.mark.parametrize("where", ["manifest.ocdbt", "plain .zarray", "plain chunk"])
def test_a_fifo_inside_the_checkpoint_is_refused_without_blocking(tmp_path, where):
    if where == "manifest.ocdbt":
        path = _ocdbt_checkpoint(tmp_path)
        fifo = path / "manifest.ocdbt"
    else:
        path, _ = _plain_checkpoint(tmp_path)
        fifo = path / "w" / (".zarray" if where == "plain .zarray" else "0")
    fifo.unlink()
    os.mkfifo(fifo)
    assert f"{fifo} is not a regular file" in _load_in_subprocess(path)


def test_a_fifo_behind_a_symlinked_directory_is_refused(tmp_path):
    # The link stays inside the checkpoint (one that leaves it is refused for that alone).
    path = _ocdbt_checkpoint(tmp_path)
    (path / "d").rename(path / "d_real")
    (path / "d").symlink_to(path / "d_real")
    os.mkfifo(path / "d_real" / "extra")
    assert "extra is not a regular file" in _load_in_subprocess(path)


def test_a_fifo_behind_a_directory_linked_from_outside_is_refused(tmp_path):
    path = _ocdbt_checkpoint(tmp_path)
    (path / "d").rename(tmp_path / "elsewhere")
    (path / "d").symlink_to(tmp_path / "elsewhere")
    os.mkfifo(tmp_path / "elsewhere" / "extra")
    # Refused, never opened: for the first of its files the listing meets (one outside the
    # checkpoint, or the FIFO).
    said = _load_in_subprocess(path)
    assert "outside the checkpoint directory" in said or "extra is not a regular file" in said


def test_an_oversized_sparse_manifest_is_refused_before_it_is_read(tmp_path):
    # tensorstore read a sparse 8 GiB manifest whole (8 GiB resident, ~50 s).
    path = _ocdbt_checkpoint(tmp_path)
    with open(path / "manifest.ocdbt", "r+b") as f:
        f.truncate((64 << 20) + 1)
    with pytest.raises(CheckpointFormatError, match=r"manifest.ocdbt has 67108865 bytes, more"):
        load_orbax_checkpoint(path)


def test_an_oversized_sparse_chunk_file_of_the_plain_layout_is_refused(tmp_path):
    path, _ = _plain_checkpoint(tmp_path)
    with open(path / "w" / "0", "r+b") as f:
        f.truncate(256 << 20)
    with pytest.raises(CheckpointFormatError, match=r"a chunk file of array 'w', has 268435456"):
        load_orbax_checkpoint(path)


def test_a_symlinked_item_and_a_symlink_loop_are_read_or_refused_cleanly(tmp_path):
    real = _ocdbt_checkpoint(tmp_path)
    os.symlink(real, real / "d" / "loop")  # a link back up: walked once
    (tmp_path / "run" / "12").mkdir(parents=True)
    (tmp_path / "run" / "12" / "model").symlink_to(real)
    (tmp_path / "run" / "12" / "_CHECKPOINT_METADATA").write_text("{}")
    out = load_orbax_checkpoint(tmp_path / "run")
    assert out["w"].tobytes() == np.arange(3.0).tobytes()


def test_links_back_up_inside_a_plain_array_directory_are_walked_once(tmp_path):
    # Two links to "." would make a naive walk visit 2**40 paths (the chunk-size check).
    path, _ = _plain_checkpoint(tmp_path)
    os.symlink(".", path / "w" / "l0")
    os.symlink(".", path / "w" / "l1")
    started = time.monotonic()
    out = load_orbax_checkpoint(path)
    assert time.monotonic() - started < 10
    assert out["w"].tobytes() == np.arange(3.0).tobytes()


# ------------------------------------------------------------------------------ run directories


def test_a_run_directory_with_steps_named_two_ways_is_refused_not_guessed(tmp_path, capsys):
    from eqx_train._cli import main

    run = tmp_path / "run"
    ocp.PyTreeCheckpointer().save(run / "checkpoint_3", {"w": np.arange(3.0)})
    ocp.PyTreeCheckpointer().save(run / "backup_99", {"w": np.zeros(3)})
    with pytest.raises(CheckpointFormatError, match=r"named in 2 ways \(backup_99, checkpoint_3\)"):
        load_orbax_checkpoint(run)
    assert main(["convert-orbax", str(run), str(tmp_path / "dst")]) != 0
    assert "named in 2 ways" in capsys.readouterr().err
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize(
    "options",
    [{"step_format_fixed_length": 5}, {"step_prefix": "run", "step_format_fixed_length": 3}],
)
def test_the_latest_step_of_a_manager_with_padded_or_prefixed_step_names(tmp_path, options):
    with ocp.CheckpointManager(
        tmp_path, options=ocp.CheckpointManagerOptions(**options), item_names=("model",)
    ) as manager:
        for step in (2, 9, 10):
            manager.save(
                step, args=ocp.args.Composite(model=ocp.args.PyTreeSave({"s": np.full(1, step)}))
            )
        manager.wait_until_finished()
    assert load_orbax_checkpoint(tmp_path, item="model")["s"].tolist() == [10]


# ------------------------------------------------------------------------------ convert-orbax


KILLED_CONVERT = textwrap.dedent(
    """
    import os, signal, sys
    from eqx_train._cli import main

    src, dst, victim = sys.argv[1:4]
    for name in ("replace", "link", "rename"):
        real = getattr(os, name)

        def move(a, b, *rest, _real=real, **kw):
            # Dies just before the converted step `victim` would become visible in DST.
            if os.path.basename(os.fspath(b)).startswith(victim):
                print("KILL-POINT before", b, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return _real(a, b, *rest, **kw)

        setattr(os, name, move)
    main(["convert-orbax", src, dst])
    print("SURVIVED", flush=True)
    """
)


def test_convert_orbax_killed_mid_conversion_leaves_dst_valid_with_the_steps_done(tmp_path):
    from flax.training import checkpoints as flax_checkpoints

    from eqx_train.checkpoints import available_steps, restore_checkpoint

    src, dst = tmp_path / "src", tmp_path / "dst"
    for step in (1, 2):
        flax_checkpoints.save_checkpoint(
            src, {"w": np.full(4, step, np.float32)}, step=step, keep=2
        )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-u", "-c", KILLED_CONVERT, str(src), str(dst), "checkpoint_2"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == -9 and "KILL-POINT before" in done.stdout, done.stderr[-2000:]
    assert "checkpoint_1 ->" in done.stdout  # the kill landed after step 1, inside step 2
    assert available_steps(dst) == [1]
    restored = restore_checkpoint(dst, None)
    assert restored["w"].tobytes() == np.full(4, 1, np.float32).tobytes()
    # Running it again says how to go on rather than only refusing.
    again = subprocess.run(
        [sys.executable, "-m", "eqx_train", "convert-orbax", str(src), str(dst)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert again.returncode != 0 and "resuming an interrupted conversion?" in again.stderr
    assert available_steps(dst) == [1]


def test_inspect_of_a_run_with_steps_named_two_ways_names_them_not_a_guessed_latest(
    tmp_path, capsys
):
    from eqx_train._cli import main

    run = tmp_path / "run"
    ocp.PyTreeCheckpointer().save(run / "checkpoint_3", {"w": np.arange(3.0)})
    ocp.PyTreeCheckpointer().save(run / "backup_99", {"w": np.zeros(3)})
    assert main(["inspect", str(run)]) == 1
    captured = capsys.readouterr()
    assert "latest" not in captured.out
    assert "named in 2 ways (backup_99, checkpoint_3)" in captured.err


def test_two_leaves_saved_under_one_orbax_name_are_refused_where_orbax_loses_one(tmp_path):
    # orbax writes {"a.b": x, "a": {"b": y}} as one array named a.b and restores x twice.
    path = tmp_path / "clash"
    ocp.PyTreeCheckpointer().save(path, {"a.b": np.ones(2), "a": {"b": np.zeros(2)}})
    with pytest.raises(CheckpointFormatError, match="two leaves are both named 'a.b'"):
        load_orbax_checkpoint(path)


# ------------------------------------------------------------------------------ deep metadata


def _deep_metadata(kind: str) -> str:
    if kind == "one leaf 3000 keys deep":
        keys = [{"key": f"k{i}", "key_type": 2} for i in range(3000)]
        entry = {"key_metadata": keys, "value_metadata": {"value_type": "None"}}
        return json.dumps({"tree_metadata": {"deep": entry}})
    return '{"tree_metadata": {}, "custom_metadata": ' + "[" * 3000 + "]" * 3000 + "}"


@pytest.mark.parametrize("kind", ["one leaf 3000 keys deep", "JSON 3000 levels deep"])
def test_metadata_nested_thousands_of_levels_deep_is_a_format_error_naming_it(tmp_path, kind):
    path, _ = _plain_checkpoint(tmp_path)
    (path / "_METADATA").write_text(_deep_metadata(kind))
    with pytest.raises(CheckpointFormatError, match=f"{path / '_METADATA'} .*nested"):
        load_orbax_checkpoint(path)


def test_convert_orbax_of_deeply_nested_metadata_prints_one_line(tmp_path, capsys):
    from eqx_train._cli import main

    path, _ = _plain_checkpoint(tmp_path)
    (path / "_METADATA").write_text(_deep_metadata("one leaf 3000 keys deep"))
    assert main(["convert-orbax", str(path), str(tmp_path / "dst"), "--step", "1"]) == 1
    captured = capsys.readouterr()
    [line] = captured.err.splitlines()
    assert str(path / "_METADATA") in line and "3000 levels deep" in line


# ------------------------------------------------------------------------------ symbolic links


def test_a_chunk_file_linked_outside_the_checkpoint_is_refused_naming_it(tmp_path):
    path, _ = _plain_checkpoint(tmp_path)
    secret = tmp_path / "secret"
    secret.write_bytes((path / "w" / "0").read_bytes())  # any local file, readable as a chunk
    (path / "w" / "0").unlink()
    (path / "w" / "0").symlink_to(secret)
    with pytest.raises(CheckpointFormatError, match=f"{path / 'w' / '0'} leads .* outside"):
        load_orbax_checkpoint(path)


def test_an_array_directory_linked_outside_the_checkpoint_is_refused(tmp_path):
    path, _ = _plain_checkpoint(tmp_path)
    (path / "w").rename(tmp_path / "elsewhere")
    (path / "w").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointFormatError, match="outside the checkpoint directory"):
        load_orbax_checkpoint(path)


def test_convert_orbax_copies_nothing_through_a_link_out_of_the_checkpoint(tmp_path, capsys):
    from eqx_train._cli import main

    path, _ = _plain_checkpoint(tmp_path)
    secret = tmp_path / "secret"
    secret.write_bytes((path / "w" / "0").read_bytes())
    (path / "w" / "0").unlink()
    (path / "w" / "0").symlink_to(secret)
    dst = tmp_path / "dst"
    assert main(["convert-orbax", str(path), str(dst), "--step", "1"]) == 1
    assert "outside the checkpoint directory" in capsys.readouterr().err
    assert not dst.exists() or not any(dst.iterdir())


def test_a_chunk_file_linked_inside_the_checkpoint_is_read(tmp_path):
    path, _ = _plain_checkpoint(tmp_path)
    (path / "w" / "0").rename(path / "chunk-w-0")
    (path / "w" / "0").symlink_to(os.path.join("..", "chunk-w-0"))
    assert load_orbax_checkpoint(path)["w"].tobytes() == np.arange(3.0).tobytes()
