"""`convert_pre_linen`: renumber pre-Linen submodule names per module class."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_NUMBER = re.compile(r"([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)")
_MODULE_WITH_INDEX = re.compile(r"(.*)_\d+$")


def _natural_key(name: str) -> list[Any]:
    # re.split with one capture group alternates text, number, text, ...; numbers compare
    # numerically, so Dense_2 sorts before Dense_10.
    return [float(part) if i % 2 else part for i, part in enumerate(_NUMBER.split(name))]


def convert_pre_linen(params: Any) -> Any:
    """Renames pre-Linen submodules (numbered across all classes) to Linen's per-class numbering.

    Pre-Linen code numbered submodules globally (`Conv_0`, `Dense_1`); Linen numbers them per
    class (`Conv_0`, `Dense_0`). Names are visited in natural order and each `{Class}_{n}` is
    renumbered from 0 within its class, recursively. Same result as flax's function.

    **Arguments:**

    - `params`: a nested mapping of parameters. Anything that is not a mapping is returned
      as is, so it is safe to call on an already-converted tree.

    **Returns:**

    A new nested `dict` with Linen names.
    """
    if not isinstance(params, Mapping):
        return params
    counts: dict[str, int] = {}
    renamed: dict[str, Any] = {}
    for name in sorted(params.keys(), key=_natural_key):
        new_name = name
        match = _MODULE_WITH_INDEX.match(name)
        if match:
            module = match.group(1)
            new_name = f"{module}_{counts.get(module, 0)}"
            counts[module] = counts.get(module, 0) + 1
        renamed[new_name] = convert_pre_linen(params[name])
    return renamed
