"""Several items of one Orbax `CheckpointManager` step read as one tree: NNX's guide saves
the model's state and the optimizer's as two items (`model`, `optimizer`), and a
`TrainState` holds both. Each item's tensors are named under the item's name
(`model.conv1.kernel`, `optimizer.opt_state.0.mu.conv1.kernel`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..checkpoints.engine import CheckpointFormatError
from ._orbax_layout import resolve

# An item's reader: `_orbax.OrbaxReader` (given by the caller: this module is imported by
# that one, never the other way).
OrbaxReader = Any


class ItemsReader:
    """The items of one step as one checkpoint `Reader`, each item's names under its own."""

    has_description = False

    def __init__(self, step: str, readers: dict[str, OrbaxReader]):
        self.path, self.metadata = step, {}
        self.readers = readers
        self._where: dict[str, tuple[OrbaxReader, str]] = {}
        self._shapes: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        for item, reader in readers.items():
            for name, shape in reader.arrays().items():
                self._where[f"{item}.{name}"] = (reader, name)
                self._shapes[f"{item}.{name}"] = shape

    def bad(self, why: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self.path} is not a valid Orbax checkpoint: {why}.")

    def __enter__(self) -> ItemsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()

    def check_unchanged(self) -> None:
        """Nothing to check: orbax never rewrites a committed checkpoint in place."""

    def description(self) -> Any:
        raise self.bad("it has no eqx_train tree description (see `tree()`)")

    def files(self) -> dict[str, Any]:
        return {}

    def arrays(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return self._shapes

    def read(
        self, name: str, index: tuple[slice, ...] | None = None, *, verify: bool = True
    ) -> np.ndarray:
        reader, inner = self._where[name]
        return reader.read(inner, index, verify=verify)

    def read_many(
        self, names: Sequence[str], *, verify: bool = True, parallel: bool = True
    ) -> dict[str, np.ndarray]:
        found: dict[str, np.ndarray] = {}
        for reader in self.readers.values():
            mine = [n for n in names if self._where[n][0] is reader]
            if mine:
                read = reader.read_many([self._where[n][1] for n in mine], verify=verify)
                found.update({n: read[self._where[n][1]] for n in mine})
        return found

    def tree(self) -> dict[str, Any]:
        return {item: reader.tree() for item, reader in self.readers.items()}


def open_items(
    path: str, items: Sequence[str], opener: Callable[[str], OrbaxReader]
) -> ItemsReader:
    """The `items` of the `CheckpointManager` step at `path` (or of a run's latest step) as
    one reader, each item's opened by `opener` (its directory -> its reader).

    **Raises:**

    `ValueError` for no item, an item named twice, or an item the step lacks (listing its
    items), as for one `item`."""
    if not items or len(set(items)) != len(items):
        raise ValueError(
            f"load_orbax_checkpoint: item= must name one item or several different ones, "
            f"got {list(items)!r}."
        )
    directories = {item: resolve(path, item) for item in items}
    step = os.path.dirname(next(iter(directories.values())).rstrip(os.sep))
    readers: dict[str, OrbaxReader] = {}
    try:
        for item, directory in directories.items():
            readers[item] = opener(directory)
    except BaseException:
        for reader in readers.values():
            reader.close()
        raise
    return ItemsReader(step, readers)
