"""Tools for testing training code built on eqx_train: hypothesis strategies of arrays,
pytrees, models and train states (`strategies`); tree comparisons that say where two trees
differ (`assert_trees_equal`); ready-made laws (`assert_checkpoint_roundtrip`,
`assert_resumes_exactly`); and a pytest plugin (`-p eqx_train.testing`: `--cpu-devices N`,
fixtures `checkpoint_dir` and `cpu_mesh`).

Needs hypothesis and pytest: `pip install 'eqx_train[testing]'`.
"""

try:
    import hypothesis as _hypothesis  # noqa: F401  (checked here to name the extra)
    import pytest as _pytest  # noqa: F401
except ImportError as error:
    raise ImportError(
        f"eqx_train.testing needs hypothesis and pytest, which eqx_train installs only with "
        f"its `testing` extra: pip install 'eqx_train[testing]' (missing: {error.name})."
    ) from error

from eqx_train_pytest import (
    checkpoint_dir as checkpoint_dir,
    cpu_mesh as cpu_mesh,
    pytest_addoption as pytest_addoption,
    pytest_configure as pytest_configure,
    pytest_report_header as pytest_report_header,
)

from . import strategies as strategies
from ._compare import assert_trees_equal as assert_trees_equal
from ._laws import (
    assert_checkpoint_roundtrip as assert_checkpoint_roundtrip,
    assert_resumes_exactly as assert_resumes_exactly,
)

__all__ = [
    "assert_checkpoint_roundtrip",
    "assert_resumes_exactly",
    "assert_trees_equal",
    "checkpoint_dir",
    "cpu_mesh",
    "strategies",
]
