"""What tests/conftest.py promises about the suite itself: eqx_train is type-checked as it
runs (module functions, with their array shapes), and XLA's quick compilation reaches the
processes the tests start."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import jaxtyping
import pytest

import eqx_train
from eqx_train import lr_schedule


def test_a_module_function_called_with_a_wrong_type_is_refused_as_it_runs():
    with pytest.raises(jaxtyping.TypeCheckError, match="steps_per_epoch"):
        lr_schedule.create_constant_learning_rate_schedule(0.1, "ten")  # type: ignore[arg-type]


def test_an_array_annotation_is_checked_as_it_runs():
    # onehot's labels are integers: floats are refused by their annotation's dtype.
    with pytest.raises(jaxtyping.TypeCheckError):
        eqx_train.common_utils.onehot(jnp.zeros(3, jnp.float32), 4)  # type: ignore[arg-type]


def test_a_function_defined_inside_another_is_left_unwrapped():
    def inner(x: int) -> int:
        return x

    assert jaxtyping.jaxtyped(typechecker=None)(inner) is inner


def test_quick_compilation_is_on_here_and_in_the_processes_tests_start():
    # On unless whoever runs the suite set the variable (to 0, to test XLA's optimisations).
    here = jax.config.values["jax_disable_most_optimizations"]
    if os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1":  # conftest's default
        assert here is True
    code = "import jax; print(jax.config.values['jax_disable_most_optimizations'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(here)


def test_quick_xla_flags_are_set_where_xla_knows_them_and_reach_workers_with_their_devices():
    from tests.conftest import QUICK_XLA_FLAGS, _xla_knows
    from tests.support.helpers import worker_env, xla_flags

    # Without the device counts an earlier test may have set here (the example, imported).
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    if os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1":
        assert all(f in flags for f in QUICK_XLA_FLAGS) == _xla_knows(QUICK_XLA_FLAGS)
    assert worker_env()["XLA_FLAGS"].split() == flags
    assert xla_flags(3).split() == [*flags, "--xla_force_host_platform_device_count=3"]
    code = "import jax; print(jax.device_count())"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(3)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == "3"
