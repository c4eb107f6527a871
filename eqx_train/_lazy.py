"""Deferred imports: the command line (`python -m eqx_train inspect`) reads checkpoint
headers without importing JAX, which takes longer to import than the whole command needs.

Two tools, each used where a module must be importable without JAX:

- `LazyModule("jax")` stands in for a module and imports it on first attribute access;
- `exports(package, {name: submodule})` gives a package a PEP 562 `__getattr__` that
  imports a re-exported name's submodule on first access.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable, Mapping
from typing import Any


class LazyModule(types.ModuleType):
    """A module imported on first attribute access."""

    def __init__(self, name: str):
        super().__init__(name)
        self._eqx_train_module: types.ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        # The module is kept, not its attributes: a test that patches `jax.device_put` is
        # still seen. (Attribute lookups here cost ~3 us each through `import_module`.)
        module = self._eqx_train_module
        if module is None:
            module = self._eqx_train_module = importlib.import_module(self.__name__)
        return getattr(module, attr)


def exports(
    package: str, names: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`, which re-exports `names` (name ->
    submodule, relative to the package; a submodule maps to itself)."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(f"{package}.{names[name]}")
        return module if names[name] == name else getattr(module, name)

    def __dir__() -> list[str]:
        return sorted(names)

    return __getattr__, __dir__
