"""Hypothesis profiles: `ci` (fast, derandomised; the default) and `thorough`."""

import os

from hypothesis import HealthCheck, settings

import tests.conftest  # noqa: F401  (8 simulated CPU devices, as for tests/)

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
