"""The pytest plugin of `eqx_train.testing`: `--cpu-devices N` and the fixtures
`checkpoint_dir` and `cpu_mesh`.

It lives outside the `eqx_train` package because pytest may load it in every session of
everyone who installed eqx_train (the `pytest11` entry point), before any conftest.py: so
it imports only pytest at load time (not eqx_train, JAX or hypothesis: a suite that has
jaxtyping's import hook check eqx_train needs eqx_train imported after the hook), and does
nothing until used. `--cpu-devices` unset
changes nothing, and a fixture runs only for the tests that request it. `eqx_train.testing`
re-exports these hooks, so that `-p eqx_train.testing` loads the same plugin where the
entry point is not installed or pytest's plugin autoloading is off.
"""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from jax.sharding import Mesh

__all__ = ["checkpoint_dir", "cpu_mesh"]

# The most CPU devices `--cpu-devices` gives: XLA starts 1024 in about two seconds, while
# 4096 take over ten and 100000 stall the session without a word (10**8 abort it).
_MAX_CPU_DEVICES = 1024


def _device_count(text: str) -> int:
    """`--cpu-devices`'s value: a count in ASCII digits from 1 to `_MAX_CPU_DEVICES` (not
    `int()`, which also reads "+1", " 1", "1_0" and every script's digits)."""
    # Past its leading zeros, no longer than the maximum: `int()` refuses 4300 digits.
    digits = text.lstrip("0") if text.isascii() and text.isdigit() else ""
    if len(digits) > len(str(_MAX_CPU_DEVICES)) or not 1 <= int(digits or "0") <= _MAX_CPU_DEVICES:
        shown = repr(text) if len(text) <= 40 else f"{text[:20]!r}... ({len(text)} characters)"
        raise pytest.UsageError(
            f"--cpu-devices {shown}: give a number of CPU devices from 1 to "
            f"{_MAX_CPU_DEVICES}, in digits."
        )
    return int(digits)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("eqx_train", "eqx_train.testing")
    group.addoption(
        "--cpu-devices",
        type=str,
        default=None,
        metavar="N",
        help=(
            f"run JAX with N CPU devices, 1 <= N <= {_MAX_CPU_DEVICES} (sets "
            "jax_num_cpu_devices once the root conftest.py files are imported, so it overrides "
            "a value they set; JAX must not have run anything yet)"
        ),
    )


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    text = config.getoption("cpu_devices", None)
    if text is None:
        return
    count = _device_count(text)
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError as error:
        raise pytest.UsageError(
            f"--cpu-devices {count}: JAX has already started its backends, so the number of "
            f"CPU devices is fixed ({error}). Something imported before the tests (a "
            "conftest.py, a plugin) ran a JAX operation at import time; move that into a "
            "fixture."
        ) from None


def pytest_report_header(config: pytest.Config) -> str | None:
    text = config.getoption("cpu_devices", None)
    return None if text is None else f"eqx_train.testing: {text} CPU devices (--cpu-devices)"


@pytest.fixture
def checkpoint_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """A fresh, empty directory for a test's checkpoints (`tmp_path / "checkpoints"`),
    kept by pytest's temporary-directory retention for inspection after a failure."""
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    return directory


@pytest.fixture
def cpu_mesh() -> Mesh:
    """A one-axis `jax.sharding.Mesh` named `"data"` over all CPU devices (as many as
    `--cpu-devices` or the test suite's own `jax_num_cpu_devices` made)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices("cpu")), ("data",))
