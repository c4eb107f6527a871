"""The local tier's units: what one process holds of a step, as one checksummed file of the
one format (`format/_format.write_file`, read back by `format/_reader.FileReader`).

A *unit* is the file
`{local_directory}/{prefix}{step}.local/process_{owner}-of-{count}.safetensors`: the blocks
of every array leaf that process `owner` of a `count`-process job held (each distinct block
once, however many of its devices hold it), its host-local leaves (NumPy
arrays, Python numbers) whole, and its `host_state`, in the sealed metadata entry
`eqx_train.local_unit` (with the step, the owner, the process count and the layout of the
leaves). A process's own unit and the peers' units it keeps sit side by side in the step's
directory. A unit becomes visible whole: written to a temporary name, fsynced, renamed (the
storage's `atomic_write`), so a kill at any moment leaves the unit complete or absent, and a
step is only restored from units that all say they are that step.

The names of the local tier live here (and only here): nothing else writes into a
`local_directory`.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import jax
else:  # imported on first use: the command line reads headers without JAX
    from ..._lazy import LazyModule

    jax = LazyModule("jax")

from ..._calls import call
from .._errors import CheckpointFormatError
from ..format import _names
from ..format._format import write_all, write_file
from ..format._leaf_kinds import Tensor
from ..format._reader import FileReader
from ..storage._base import Storage

UNIT_KEY = _names.LOCAL_UNIT_KEY
STEP_SUFFIX = _names.LOCAL_SUFFIX
_PYTHON = {"int": int, "float": float, "bool": bool, "complex": complex}


class LocalCopyMismatch(ValueError):
    """A local unit that cannot fill the target as it is (another tree, shape, dtype or
    sharding): the restore takes another tier."""


unit_name = _names.local_unit_name


def step_dir(store: Storage, local_directory: str, prefix: str, step: Any) -> str:
    return store.join(local_directory, f"{prefix}{_names.canonical_step(step)}{STEP_SUFFIX}")


@dataclass(frozen=True)
class Held:
    """A unit found in a local directory: its step, owner, the job's process count, path
    and size."""

    step: Decimal
    text: str
    owner: int
    count: int
    path: str
    size: int


def scan(store: Storage, local_directory: str, prefix: str) -> list[Held]:
    """Every unit in `local_directory` (temporary files of an interrupted write are not
    units), newest step first."""
    found = []
    for entry in store.list(local_directory):
        text = entry.name.removeprefix(prefix).removesuffix(STEP_SUFFIX)
        if not (
            entry.is_dir
            and entry.name.startswith(prefix)
            and entry.name.endswith(STEP_SUFFIX)
            and re.fullmatch(r"[0-9][0-9.e+-]*", text)
            and _names.is_canonical(text)
        ):
            continue
        for item in store.list(entry.path):
            unit = _names.parse_local_unit(item.name)
            if unit is not None and item.is_file:
                size = item.size if item.size is not None else _size(store, item.path)
                held = Held(
                    _names.step_value(text),
                    text,
                    unit[0],
                    unit[1],
                    item.path,
                    size,
                )
                found.append(held)
    return sorted(found, key=lambda h: (-h.step, h.owner))


def _size(store: Storage, path: str) -> int:
    source = store.open(path)
    try:
        return source.size
    finally:
        source.close()


# ------------------------------------------------------------------------ what a unit holds


def _bounds(index: tuple[Any, ...], shape: tuple[int, ...]) -> str:
    """A block's bounds as text ("0:4,0:6"), the same for `slice(None)` and `slice(0, d)`."""
    index = index + (slice(None),) * (len(shape) - len(index))
    return ",".join(
        f"{0 if s.start is None else s.start}:{d if s.stop is None else s.stop}"
        for s, d in zip(index, shape, strict=True)
    )


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key)


@dataclass
class Captured:
    """A host copy of what this process holds of `state`: the unit's tensors and layout."""

    tensors: list[Tensor] = field(default_factory=list)
    leaves: list[dict[str, Any]] = field(default_factory=list)
    treedef: str = ""
    nbytes: int = 0


def capture(state: Any) -> Captured:
    """This process's part of `state`, copied to the host: each distinct addressable block
    of every array leaf, host-local leaves whole; other leaves (strings, None, functions)
    are taken from the target at restore."""
    flat, treedef = jax.tree_util.tree_flatten(state)
    captured = Captured(treedef=str(treedef))
    for i, leaf in enumerate(flat):
        if isinstance(leaf, jax.Array):
            key_impl = None
            if _is_key(leaf):
                key_impl = str(jax.random.key_impl(leaf))
                leaf = jax.random.key_data(leaf)
            shape = tuple(leaf.shape)
            seen: set[str] = set()
            for shard in leaf.addressable_shards:
                bounds = _bounds(shard.index, shape)
                if bounds in seen:
                    continue
                seen.add(bounds)
                _add(captured, f"{i}/{bounds}", np.array(shard.data))
            dtype = np.dtype(leaf.dtype).str
            captured.leaves.append(
                {"kind": "blocks", "shape": list(shape), "dtype": dtype, "key": key_impl}
            )
        elif isinstance(leaf, np.ndarray | np.generic | bool | int | float | complex):
            python = type(leaf).__name__ if type(leaf).__name__ in _PYTHON else None
            _add(captured, f"{i}/host", np.array(leaf))
            captured.leaves.append({"kind": "host", "python": python})
        else:
            captured.leaves.append({"kind": "target"})
    return captured


def _add(captured: Captured, name: str, value: np.ndarray) -> None:
    captured.tensors.append(
        Tensor(name, lambda v=value: v, value.dtype, tuple(value.shape), owned=True)
    )
    captured.nbytes += value.nbytes


def host_state_json(host_state: Any) -> str:
    """`host_state` as JSON (strict: no NaN), or `TypeError` naming the call in progress:
    the one encoding of a host state, for a unit and for a persistent checkpoint alike."""
    try:
        return json.dumps(host_state, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"{call()}: host_state must be JSON-serialisable (a data iterator's "
            f"get_state(), a dict of numbers and strings), got {type(host_state).__name__}: "
            f"{error}"
        ) from None


def encode(captured: Captured, step: Any, owner: int, count: int, host_state: Any) -> bytes:
    """The unit's bytes: one file of the one format, its layout and `host_state` in its
    sealed metadata. Raises `TypeError` for a `host_state` that JSON cannot hold."""
    host = host_state_json(host_state)
    unit = {
        "step": _names.canonical_step(step),
        "owner": owner,
        "processes": count,
        "treedef": captured.treedef,
        "leaves": captured.leaves,
        "host_state": json.loads(host),
    }
    out = io.BytesIO()
    write_file(out, captured.tensors, {UNIT_KEY: json.dumps(unit, separators=(",", ":"))})
    return out.getvalue()


def write_unit(store: Storage, directory: str, name: str, data: bytes) -> str:
    """Writes a unit's bytes under `directory/name`, visible whole or not at all."""
    store.makedirs(directory)
    path = store.join(directory, name)

    def write(out: Any) -> None:
        if isinstance(out, int):
            write_all(out, memoryview(data))
        else:
            out.write(data)

    store.atomic_write(path, write)
    return path


# ------------------------------------------------------------------------ reading a unit


@dataclass(frozen=True)
class Unit:
    """A unit read and verified: its metadata and its tensors."""

    step: str
    owner: int
    count: int
    treedef: str
    leaves: list[dict[str, Any]]
    host_state: Any
    tensors: dict[str, np.ndarray]


def read_unit(store: Storage, held: Held) -> Unit:
    """The unit `held`, every tensor read and checked against its checksum.

    **Raises:** `CheckpointFormatError` naming the file when it is corrupt, or says another
    step, owner or process count than its name."""
    with FileReader(held.path, store.open(held.path)) as reader:
        raw = reader.metadata.get(UNIT_KEY)
        if raw is None:
            raise reader.bad(f"it has no {UNIT_KEY} entry: it is not a local-tier unit")
        try:
            unit = json.loads(raw)
            said = (unit["step"], unit["owner"], unit["processes"])
        except (ValueError, KeyError, TypeError):
            raise reader.bad(f"its {UNIT_KEY} entry is malformed") from None
        if said != (held.text, held.owner, held.count):
            raise reader.bad(
                f"it says step {said[0]}, process {said[1]} of {said[2]}, but its name says "
                f"step {held.text}, process {held.owner} of {held.count}"
            )
        tensors = reader.read_many(sorted(reader.tensors), verify=True)
    return Unit(
        held.text,
        held.owner,
        held.count,
        unit["treedef"],
        unit["leaves"],
        unit["host_state"],
        tensors,
    )


def place(unit: Unit, target: Any) -> Any:
    """`target` filled from `unit`: each array leaf assembled on the target's sharding from
    the unit's blocks (each device's block put on it), host-local leaves as saved.

    **Raises:** `LocalCopyMismatch` saying what differs when the unit cannot fill `target`
    as it is (another tree, a leaf of another shape or dtype, a sharding whose blocks this
    process did not save)."""
    flat, treedef = jax.tree_util.tree_flatten(target)
    if str(treedef) != unit.treedef or len(flat) != len(unit.leaves):
        raise LocalCopyMismatch("the target's tree is not the tree saved in the local tier")
    return jax.tree_util.tree_unflatten(
        treedef, [_leaf(unit, i, leaf, saved) for i, (leaf, saved) in _pairs(flat, unit)]
    )


def _pairs(flat: list[Any], unit: Unit) -> Iterator[tuple[int, tuple[Any, dict[str, Any]]]]:
    return enumerate(zip(flat, unit.leaves, strict=True))


def _leaf(unit: Unit, i: int, leaf: Any, saved: dict[str, Any]) -> Any:
    if saved["kind"] == "target":
        return leaf
    if saved["kind"] == "host":
        value = unit.tensors.get(f"{i}/host")
        if value is None:
            raise LocalCopyMismatch(f"leaf {i} is missing from the local unit")
        python = _PYTHON.get(saved["python"] or "")
        return python(value.item()) if python is not None else value
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        raise LocalCopyMismatch(f"leaf {i} of the target has no sharding to place it on")
    shape, dtype = tuple(saved["shape"]), np.dtype(saved["dtype"])
    key = saved["key"]
    leaf_shape = tuple(leaf.shape) + (shape[len(leaf.shape) :] if key else ())
    if leaf_shape != shape or (not key and np.dtype(leaf.dtype) != dtype):
        raise LocalCopyMismatch(
            f"leaf {i} was saved as {dtype}{list(shape)}, the target's is "
            f"{leaf.dtype}{list(leaf.shape)}"
        )
    if key:
        sharding = (
            jax.random.key_data(leaf).sharding
            if isinstance(leaf, jax.Array)
            else _data_sharding(sharding, len(shape) - len(leaf.shape))
        )
    arrays = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        bounds = _bounds(tuple(index or ()), shape)
        block = unit.tensors.get(f"{i}/{bounds}")
        if block is None:
            raise LocalCopyMismatch(f"leaf {i}'s block {bounds} is not in this process's unit")
        arrays.append(jax.device_put(block, device))
    array = jax.make_array_from_single_device_arrays(shape, sharding, arrays)
    return jax.random.wrap_key_data(array, impl=key) if key else array


def _data_sharding(sharding: Any, extra: int) -> Any:
    """The sharding of a key array's data (its trailing axes whole)."""
    from jax.sharding import NamedSharding, PartitionSpec

    if not isinstance(sharding, NamedSharding):
        raise LocalCopyMismatch("an abstract PRNG key leaf must have a NamedSharding")
    return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec, *([None] * extra)))


def corrupt(held: Held, error: Exception) -> CheckpointFormatError:
    return CheckpointFormatError(f"the local-tier copy {held.path} is unusable: {error}")


def prune(store: Storage, local_directory: str, prefix: str, keep: int) -> None:
    """Deletes the units of all but the newest `keep` steps in `local_directory`."""
    steps = sorted({(h.step, h.text) for h in scan(store, local_directory, prefix)}, reverse=True)
    for _, text in steps[keep:]:
        directory = step_dir(store, local_directory, prefix, _names.step_from_text(text))
        for item in store.list(directory):
            store.remove(item.path)
        store.remove_dir_if_empty(directory)
