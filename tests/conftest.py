"""The one place that configures JAX for the test suites (tests/ and property_tests/).

The suites run on 8 simulated CPU devices, so the multi-device code paths run on any
machine. Tests that start subprocesses give those their own environment.
"""

import jax
import jaxtyping
import pytest

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture
def without_type_checks():
    """Turns off the suite's run-time type checking (pyproject's `--jaxtyping-packages`) for
    one test, as for a user who runs none: for tests of eqx_train's own errors on wrongly
    typed input, which the type checker would otherwise reject first."""
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", before)
