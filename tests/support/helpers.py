"""Tree comparisons for the tests, built on `eqx.tree_equal`; subprocess runners; where the
worker scripts are."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

SUPPORT = os.path.dirname(os.path.abspath(__file__))
"""This folder: the worker scripts that tests start as processes live here."""
ROOT = os.path.dirname(os.path.dirname(SUPPORT))
"""The repository root, which a worker needs on its PYTHONPATH to import `tests.support`."""

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def xla_flags(device_count: int | None = None) -> str:
    """`XLA_FLAGS` for a process a test starts: the suite's (tests/conftest.py's quick
    compilation), with `device_count` simulated CPU devices, or XLA's one by default."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if _DEVICE_COUNT_FLAG not in f]
    if device_count is not None:
        kept.append(f"{_DEVICE_COUNT_FLAG}={device_count}")
    return " ".join(kept)


def worker_env(**extra: str) -> dict[str, str]:
    """The environment of a worker process: this one's, with `ROOT` on its PYTHONPATH, the
    suite's `xla_flags()` and no platform chosen (a worker picks its own platform and device
    count, appending the count to `XLA_FLAGS`), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["XLA_FLAGS"] = xla_flags()
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return {**env, **extra}


def latest_path(directory: Any, **kwargs: Any) -> str:
    """`checkpoints.latest_checkpoint(directory, **kwargs)` where the test has saved one: its
    path, never None."""
    from eqx_train import checkpoints

    path = checkpoints.latest_checkpoint(directory, **kwargs)
    assert path is not None, f"no checkpoint in {directory}"
    return path


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def _bits(x: Any, check_dtype: bool = True) -> Any:
    """An array leaf as `(dtype, bytes)`: equal exactly when the arrays are bit-identical
    with the same dtype and shape (so NaN equals the same NaN, and -0.0 differs from 0.0)."""
    if not _is_array(x):
        return x
    dtype = x.dtype if check_dtype else None
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    x = np.asarray(x)
    return dtype, x.reshape(-1).view(np.uint8).reshape(*x.shape, x.dtype.itemsize)


def _nan_split(x: Any) -> Any:
    """An inexact array leaf as `(where it is NaN, its values with NaNs set to 0)`."""
    if not (_is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)):
        return x
    nan = np.isnan(np.asarray(x))
    return nan, np.where(nan, np.zeros((), x.dtype), x)


def _explain(a: Any, b: Any, equal) -> str:
    """Names the leaves that differ, or shows both structures when those differ."""
    (leaves_a, tree_a), (leaves_b, tree_b) = (jtu.tree_flatten_with_path(t) for t in (a, b))
    if tree_a != tree_b:
        return f"structures differ:\n{tree_a}\n{tree_b}"
    return "leaves differ:\n" + "\n".join(
        f"{jtu.keystr(path)}: {x!r} vs {y!r}"
        for (path, x), (_, y) in zip(leaves_a, leaves_b, strict=True)
        if not equal(x, y)
    )


def assert_trees_equal(a: Any, b: Any, *, check_dtype: bool = True) -> None:
    """Same structure, equal non-array leaves, and bit-identical arrays of the same shape and
    (unless `check_dtype=False`) dtype; NaNs are equal when their bits are. A JAX array and a
    NumPy array may stand for each other."""

    def bits(tree):
        return jtu.tree_map(lambda x: _bits(x, check_dtype), tree)

    def equal(x, y):
        return bool(eqx.tree_equal(bits(x), bits(y)))

    assert equal(a, b), _explain(a, b, equal)


def tree_allclose(a: Any, b: Any, *, rtol: float = 1e-6, atol: float = 0.0) -> bool:
    """Same structure, equal non-array leaves, arrays of the same dtype and shape with close
    values, and NaN in the same places."""
    split_a, split_b = jtu.tree_map(_nan_split, a), jtu.tree_map(_nan_split, b)
    return bool(eqx.tree_equal(split_a, split_b, rtol=rtol, atol=atol))


def run_then_sigkill(script: str, argument: str, *, after_line: int, delay: float) -> None:
    """Runs `python -c script argument`, waits until it prints an int >= `after_line`, sleeps
    `delay` seconds, then SIGKILLs it (and never leaves it running)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags()}
    process = subprocess.Popen(
        [sys.executable, "-c", script, argument], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if int(line) >= after_line:
                break
        else:
            raise AssertionError(
                f"the child exited (code {process.wait()}) before line {after_line}"
            )
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a jax.distributed coordinator)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(commands: list[tuple[list[str], dict[str, str]]], timeout: float) -> list:
    """Starts every `(argv, env)` at once (peers of one job), waits for all, and returns
    `(returncode, combined output)` for each; never leaves a straggler running."""
    from tests.support.fork_server import spawn

    processes = [spawn(argv, env, peer) for peer, (argv, env) in enumerate(commands)]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=timeout)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return [(p.returncode, out) for p, out in zip(processes, outputs, strict=True)]


def assert_identical(ours: Any, theirs: Any, path: str = "<root>") -> None:
    """Same container types, key order, leaf types, dtypes, shapes and bytes (a NaN scalar
    matches a NaN scalar): what a reader of another library's checkpoint must return."""
    assert type(ours) is type(theirs), f"{path}: {type(ours)} != {type(theirs)}"
    if isinstance(theirs, dict):
        assert list(ours) == list(theirs), f"{path}: keys {list(ours)} != {list(theirs)}"
        for key in theirs:
            assert_identical(ours[key], theirs[key], f"{path}.{key}")
    elif isinstance(theirs, list):
        assert len(ours) == len(theirs), path
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_identical(a, b, f"{path}.{i}")
    elif isinstance(theirs, np.ndarray | np.generic):
        assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape), path
        assert ours.tobytes() == theirs.tobytes(), path
    else:
        assert ours == theirs or (ours != ours and theirs != theirs), f"{path}: {ours!r}"


def flip_last_byte(path: Any) -> None:
    """Corrupts a checkpoint's tensor data (its last byte, inverted): its checksum fails."""
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))


def hold_the_writer(monkeypatch: Any) -> tuple[Any, Any]:
    """Makes the checkpoint writer wait, before its first byte, until the returned `go` event
    is set; `writing` is set once it waits: a test then acts while the save is provably in
    flight."""
    import threading

    from eqx_train.checkpoints.format import _format

    go, writing = threading.Event(), threading.Event()
    real = _format.write_all

    def write_all(fd: int, data: Any) -> None:
        writing.set()
        assert go.wait(60), "the test never let the writer go on"
        real(fd, data)

    monkeypatch.setattr(_format, "write_all", write_all)
    return go, writing


def main_thread_is_in(function_name: str) -> bool:
    """Whether the main thread is, right now, inside a call of a function of that name (for
    tests that deliver an interrupt at a known point of a wait)."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    while frame is not None:
        if frame.f_code.co_name == function_name:
            return True
        frame = frame.f_back
    return False
