"""The one place that configures JAX for the test suites (tests/ and property_tests/).

The suites run on 8 simulated CPU devices, so the multi-device code paths run on any
machine. Tests that start subprocesses give those their own environment.
"""

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
