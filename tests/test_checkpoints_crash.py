"""SIGKILL in the middle of a save never costs a checkpoint, and the next save cleans up.

Every kill here lands at a known point: the child process replaces the function that writes
the bytes (`_format.write_all`) with one that writes up to a chosen byte offset of the file
(in the header, right after it, in the middle of a tensor), or the function that commits the
file (`os.replace` / `os.link` / `os.rename`) with one that stops just before or just after
the move; it then prints a `KILL-POINT` line, flushes, and SIGKILLs its own process. The
parent asserts the line was printed and the child died by SIGKILL, so every test knows the
kill landed mid-save (no sleeps, no timing luck).

Laws, after every kill:
- the previous checkpoint is intact and restores bit for bit; no name of a checkpoint holds
  a partial file (the listing shows only complete checkpoints);
- the killed save's temporary file is still there (proof of where it died), and the next
  save by `save_checkpoint` or an `AsyncManager` save removes it -- only it: temporaries of
  other prefixes and of live processes stay;
- kills repeated 12 times never accumulate temporaries (issue 11: 207 MiB after 12 kills);
- a multi-process `.shards` overwrite killed around its commit restores as the old or the
  new checkpoint, never neither.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from eqx_train import checkpoints
from tests.support.fork_server import spawn
from tests.support.helpers import assert_trees_equal

pytestmark = pytest.mark.slow

CHILD = textwrap.dedent(
    """
    import json, os, signal, sys, threading
    import numpy as np
    from eqx_train import checkpoints
    from eqx_train.checkpoints.format import _format

    args = json.loads(sys.argv[1])

    def tree(version):
        return {
            "b": np.arange(1000, dtype=np.int64) * version,
            "version": version,
            "w": np.full((64, 1024), version, np.float32),
        }

    def die(where):
        print("KILL-POINT", where, "in thread", threading.current_thread().name, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def hook_write_all(kill_at):
        # Dies when the file being written reaches `kill_at` bytes (mid-call if need be).
        real, written = _format.write_all, [0]

        def write_all(fd, data):
            room = kill_at - written[0]
            if room <= len(data):
                real(fd, data[: max(room, 0)])
                die(f"at byte {kill_at} of the file")
            real(fd, data)
            written[0] += len(data)

        _format.write_all = write_all

    def hook_commit(suffix, before):
        # Dies just before or just after the move of a finished file to a name ending in
        # `suffix` (whichever of os.replace, os.link, os.rename the save uses).
        for name in ("replace", "link", "rename"):
            real = getattr(os, name)

            def move(src, dst, *a, _real=real, **k):
                if not os.fspath(dst).endswith(suffix):
                    return _real(src, dst, *a, **k)
                if before:
                    die(f"before moving the file to {dst}")
                _real(src, dst, *a, **k)
                die(f"after moving the file to {dst}")

            setattr(os, name, move)

    d, mode, prefix = args["dir"], args["mode"], args["prefix"]
    if mode == "multiprocess":
        checkpoints.save_checkpoint_multiprocess(d, tree(1), 1, prefix=prefix)
        print("OLD-SAVED", flush=True)
        hook_commit("index.safetensors", args["before"])
        checkpoints.save_checkpoint_multiprocess(d, tree(2), 1, prefix=prefix, overwrite=True)
    else:
        if "commit_before" in args:
            hook_commit(".safetensors", args["commit_before"])
        else:
            hook_write_all(args["kill_at"])
        step = args["step"]
        if mode == "save":
            checkpoints.save_checkpoint(d, tree(step), step, prefix=prefix)
        elif mode == "async":
            manager = checkpoints.AsyncManager()
            checkpoints.save_checkpoint(d, tree(step), step, prefix=prefix, async_manager=manager)
            manager.wait_previous_save()
        elif mode == "async_device":
            # The state on the device, snapshotted there; the next step donates its buffers
            # while the background thread writes.
            import jax

            state = {**tree(step), "w": jax.device_put(tree(step)["w"])}
            manager = checkpoints.AsyncManager()
            checkpoints.save_checkpoint(
                d, state, step, prefix=prefix, async_manager=manager, snapshot="device"
            )
            jax.jit(lambda w: w * 0 - 1, donate_argnums=0)(state["w"]).block_until_ready()
            manager.wait_previous_save()
        elif mode == "manager":
            checkpoints.CheckpointManager(d, prefix=prefix).save(step, tree(step))
    print("SURVIVED", flush=True)
    """
)


def tree(version):
    """The checkpoint of `version`: every leaf says which version it is."""
    return {
        "b": np.arange(1000, dtype=np.int64) * version,
        "version": version,
        "w": np.full((64, 1024), version, np.float32),
    }


def kill_child_mid_save(ckpt_dir, mode, *, prefix="checkpoint_", **hook) -> tuple[int, str]:
    """Runs the child; returns (its pid, its output). Fails unless it printed KILL-POINT and
    died by SIGKILL."""
    args = json.dumps({"dir": str(ckpt_dir), "mode": mode, "prefix": prefix, **hook})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root}
    child = spawn([sys.executable, "-c", CHILD, args], env)
    try:
        out, _ = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert "KILL-POINT" in out and child.returncode == -signal.SIGKILL, (
        f"the kill did not land mid-save (exit {child.returncode}):\n{out[-3000:]}"
    )
    assert "SURVIVED" not in out
    return child.pid, out


def temporaries(ckpt_dir, final=r".+"):
    """Hidden names of the documented form `.{final}.tmp-{host8hex}-{pid}-{16hex}` ->
    (host, pid)."""
    pattern = re.compile(rf"\.(?:{final})\.tmp-(?P<host>[0-9a-f]{{8}})-(?P<pid>\d+)-[0-9a-f]{{16}}")
    found = {}
    for name in os.listdir(ckpt_dir):
        match = pattern.fullmatch(name)
        if match:
            found[name] = (match["host"], int(match["pid"]))
    return found


def assert_only_complete_checkpoints(ckpt_dir, versions, prefix="checkpoint_"):
    """The visible names are exactly `{prefix}{v}.safetensors` for `versions` (the test
    saves version v at step v), each restoring bit for bit; the newest is what a plain
    restore gives."""
    visible = sorted(n for n in os.listdir(ckpt_dir) if not n.startswith("."))
    wanted = sorted(f"{prefix}{v}.safetensors" for v in versions)
    assert [n for n in visible if n.startswith(prefix)] == wanted
    for v in versions:
        restored = checkpoints.restore_checkpoint(ckpt_dir, None, step=v, prefix=prefix)
        assert_trees_equal(restored, tree(v))
    newest = max(versions)
    assert_trees_equal(
        checkpoints.restore_checkpoint(ckpt_dir, tree(0), prefix=prefix), tree(newest)
    )


def the_killed_temporary(ckpt_dir, pid, final):
    """The one temporary the killed child left, with content (the kill was mid-write)."""
    mine = {n: w for n, w in temporaries(ckpt_dir, re.escape(final)).items() if w[1] == pid}
    assert len(mine) == 1, f"expected the killed save's temporary, found {os.listdir(ckpt_dir)}"
    ((name, (host, _)),) = mine.items()
    return name, host


class LiveProcess:
    """A process that is alive for as long as the `with` block runs."""

    def __enter__(self):
        self.process = subprocess.Popen(["sleep", "600"])
        return self.process.pid

    def __exit__(self, *exc):
        self.process.kill()
        self.process.wait()


def plant(ckpt_dir, final, host, pid):
    name = f".{final}.tmp-{host}-{pid}-{os.urandom(8).hex()}"
    with open(os.path.join(ckpt_dir, name), "wb") as f:
        f.write(b"partial")
    return name


def kill_point(ckpt_dir, point):
    """A byte offset in the file of the save to kill, from the layout of the step-1 file
    (the same tree): half way through the header, right after it (before any tensor byte),
    or half way through the last tensor, `w`."""
    with open(os.path.join(ckpt_dir, "checkpoint_1.safetensors"), "rb") as f:
        header_end = 8 + int.from_bytes(f.read(8), "little")
        size = os.fstat(f.fileno()).st_size
    return {
        "in-header": header_end // 2,
        "before-first-tensor": header_end,
        "mid-last-tensor": size - tree(1)["w"].nbytes // 2,
    }[point]


@pytest.mark.parametrize("mode", ["save", "async", "async_device", "manager"])
@pytest.mark.parametrize("point", ["in-header", "before-first-tensor", "mid-last-tensor"])
def test_kill_mid_write_keeps_previous_checkpoint_and_leaves_only_its_temporary(
    tmp_path, mode, point
):
    checkpoints.save_checkpoint(tmp_path, tree(1), 1)
    kill_at = kill_point(tmp_path, point)
    pid, out = kill_child_mid_save(tmp_path, mode, step=2, kill_at=kill_at)
    assert f"at byte {kill_at} of the file" in out
    killer = out[out.index("KILL-POINT") :].splitlines()[0]
    in_background = mode in ("async", "async_device")
    assert ("MainThread" not in killer) == in_background, killer
    assert_only_complete_checkpoints(tmp_path, [1])
    name, _ = the_killed_temporary(tmp_path, pid, "checkpoint_2.safetensors")
    assert os.path.getsize(tmp_path / name) == kill_at  # exactly what was written so far


@pytest.mark.parametrize("next_save", ["save_checkpoint", "AsyncManager", "CheckpointManager"])
def test_next_save_removes_dead_writers_temporaries_of_its_prefix_only(tmp_path, next_save):
    checkpoints.save_checkpoint(tmp_path, tree(1), 1)
    kill_at = kill_point(tmp_path, "mid-last-tensor")
    pid, _ = kill_child_mid_save(tmp_path, "save", step=2, kill_at=kill_at)
    killed, host = the_killed_temporary(tmp_path, pid, "checkpoint_2.safetensors")
    other_prefix = plant(tmp_path, "other_2.safetensors", host, pid)  # dead writer, other prefix
    with LiveProcess() as live_pid:
        live = plant(tmp_path, "checkpoint_5.safetensors", host, live_pid)  # live writer
        if next_save == "save_checkpoint":
            checkpoints.save_checkpoint(tmp_path, tree(3), 3)
        elif next_save == "AsyncManager":
            manager = checkpoints.AsyncManager()
            checkpoints.save_checkpoint(tmp_path, tree(3), 3, async_manager=manager)
            manager.wait_previous_save()
        else:
            with checkpoints.CheckpointManager(tmp_path) as manager:
                manager.save(3, tree(3))
        left = set(os.listdir(tmp_path))
        assert killed not in left
        assert {other_prefix, live} <= left
    assert_only_complete_checkpoints(tmp_path, [3])
    checkpoints.save_checkpoint(tmp_path, tree(4), 4)  # the live writer has died meanwhile
    assert live not in os.listdir(tmp_path) and other_prefix in os.listdir(tmp_path)


def test_kill_after_commit_before_retention_leaves_two_complete_checkpoints(tmp_path):
    checkpoints.save_checkpoint(tmp_path, tree(1), 1)
    kill_child_mid_save(tmp_path, "save", step=2, commit_before=False)
    assert_only_complete_checkpoints(tmp_path, [1, 2])  # keep=1 not yet applied: both whole
    checkpoints.save_checkpoint(tmp_path, tree(3), 3)
    assert_only_complete_checkpoints(tmp_path, [3])
    assert not temporaries(tmp_path)


def test_kill_just_before_commit_keeps_previous_and_next_save_cleans(tmp_path):
    checkpoints.save_checkpoint(tmp_path, tree(1), 1)
    pid, _ = kill_child_mid_save(tmp_path, "save", step=2, commit_before=True)
    assert_only_complete_checkpoints(tmp_path, [1])
    name, _ = the_killed_temporary(tmp_path, pid, "checkpoint_2.safetensors")
    # The whole file was written and fsynced; it just never got its name.
    previous = tmp_path / "checkpoint_1.safetensors"
    assert (tmp_path / name).stat().st_size == previous.stat().st_size
    checkpoints.save_checkpoint(tmp_path, tree(3), 3)
    assert not temporaries(tmp_path)


def test_twelve_kills_never_accumulate_temporaries(tmp_path):
    checkpoints.save_checkpoint(tmp_path, tree(1), 1)
    kill_at = kill_point(tmp_path, "mid-last-tensor")
    for step in range(2, 14):
        pid, _ = kill_child_mid_save(tmp_path, "save", step=step, kill_at=kill_at)
        # Each killed save first removed the one before it: exactly one temporary, its own.
        _, host = the_killed_temporary(tmp_path, pid, f"checkpoint_{step}.safetensors")
        assert list(temporaries(tmp_path).values()) == [(host, pid)]
        assert_only_complete_checkpoints(tmp_path, [1])
    checkpoints.save_checkpoint(tmp_path, tree(20), 20)
    assert not temporaries(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_20.safetensors"]


# ------------------------------------------------------------------ multi-process overwrite


def shards_files(directory):
    return sorted(os.listdir(directory))


@pytest.mark.parametrize("before", [True, False], ids=["before-index-rename", "after"])
def test_kill_around_shards_overwrite_commit_gives_old_or_new_never_neither(tmp_path, before):
    """Issue 11 item 13. The old checkpoint (version 1) is overwritten at the same step by
    version 2; killed just before the new index is renamed in, restore gives version 1;
    just after, version 2. Then a new save removes the dead save's leftovers."""
    _, out = kill_child_mid_save(tmp_path, "multiprocess", before=before)
    assert out.index("OLD-SAVED") < out.index("KILL-POINT")
    assert f"{'before' if before else 'after'} moving the file to " in out
    assert "checkpoint_1.shards/index.safetensors" in out
    expected = tree(1 if before else 2)
    assert checkpoints.available_steps(tmp_path) == [1]
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, None), expected)
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, tree(0)), expected)
    shards = tmp_path / "checkpoint_1.shards"
    pieces = [n for n in shards_files(shards) if re.fullmatch(r"process_00000\..+\.safetensors", n)]
    assert len(pieces) == 2, shards_files(shards)  # old and new pieces: proof of mid-commit
    # Before the rename the new index's temporary file is still there; after it, nothing.
    assert any(n.startswith(".") for n in shards_files(shards)) == before

    checkpoints.save_checkpoint_multiprocess(tmp_path, tree(3), 2, keep=2)
    assert checkpoints.available_steps(tmp_path) == [1, 2]
    left = shards_files(shards)
    assert len(left) == 2 and "index.safetensors" in left, left  # index + the cited piece
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, None, step=1), expected)
    assert_trees_equal(checkpoints.restore_checkpoint(tmp_path, tree(0)), tree(3))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]
