"""Tree comparison helpers used by every test file."""

from __future__ import annotations

from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def _as_numpy(x: Any) -> np.ndarray:
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def assert_trees_equal(a: Any, b: Any, *, check_dtype: bool = True) -> None:
    """Same structure, same non-array leaves, bit-identical arrays (NaNs equal)."""
    leaves_a, tree_a = jtu.tree_flatten_with_path(a)
    leaves_b, tree_b = jtu.tree_flatten_with_path(b)
    assert tree_a == tree_b, f"structures differ:\n{tree_a}\n{tree_b}"
    for (path, x), (_, y) in zip(leaves_a, leaves_b, strict=True):
        where = jtu.keystr(path)
        assert _is_array(x) == _is_array(y), f"{where}: {type(x)} vs {type(y)}"
        if not _is_array(x):
            assert x is y or x == y, f"{where}: {x!r} != {y!r}"
            continue
        if check_dtype:
            assert x.dtype == y.dtype, f"{where}: dtype {x.dtype} vs {y.dtype}"
        xa, ya = _as_numpy(x), _as_numpy(y)
        assert xa.shape == ya.shape, f"{where}: shape {xa.shape} vs {ya.shape}"
        # Compare bytes, so that -0.0 vs 0.0 and NaN payloads count as differences.
        assert xa.tobytes() == ya.tobytes(), f"{where}: values differ\n{xa}\n{ya}"


def tree_allclose(a: Any, b: Any, *, rtol: float = 1e-6, atol: float = 0.0) -> bool:
    """Same structure and all array leaves close; non-array leaves equal."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if _is_array(x) != _is_array(y):
            return False
        if not _is_array(x):
            if not (x is y or x == y):
                return False
        elif np.shape(x) != np.shape(y) or not np.allclose(
            np.asarray(x, np.float64),
            np.asarray(y, np.float64),
            rtol=rtol,
            atol=atol,
            equal_nan=True,
        ):
            return False
    return True


def run_then_sigkill(script: str, argument: str, *, after_line: int, delay: float) -> None:
    """Runs `python -c script argument`, waits until it prints an int >= `after_line`, sleeps
    `delay` seconds, then SIGKILLs it (and never leaves it running)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
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
