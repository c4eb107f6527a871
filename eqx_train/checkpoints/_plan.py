"""`plan_restore`: what a restore into a target would do (which saved tensor fills each
leaf, what is cast, kept or unused, what would be refused), from the checkpoint's headers
alone, decided by the restore's own matcher (`_matching.match`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._calls import call, calling
from ._errors import StepNotFoundError
from .format import _layouts, _names
from .pipeline import _matching, _restore, _selection, _transform
from .pipeline._options import RestoreOptions
from .storage import _locations


@dataclass(frozen=True)
class RestorePlan:
    """What `restore_checkpoint` (or `CheckpointManager.restore`) would do with a target, as
    returned by `plan_restore`. `str(plan)` is a readable table.

    **Attributes:**

    - `path`: the checkpoint the plan was made for.
    - `taken`: target name -> the saved name its values come from (the same name unless
      `rename` changed it).
    - `cast`: target name -> (saved dtype, target dtype), for the taken leaves cast on the
      way in.
    - `kept`: target names that keep the target's values (no saved tensor with
      `strict=False`, left out by `filter_spec`, or given no source by `rename`).
    - `unused`: saved names no target leaf takes (the saved tensors under a sub-tree that
      `filter_spec` leaves out whole are expected to go unused, and not listed).
    - `problems`: what the restore would refuse, one line each, naming the leaf.
    - `call`: the call that reads this checkpoint with the same arguments:
      `"restore_checkpoint"` (also `CheckpointManager.restore` and, for a Hugging Face
      layout, `eqx_train.interop.load_sharded`), or `"load_flax_checkpoint"` /
      `"load_orbax_checkpoint"` for a flax or Orbax path, which `restore_checkpoint`
      refuses naming that call.
    - `transformed`: target name -> (saved shape, shape after `transform`), for the taken
      leaves that `transform` changes on the way in.
    - `conventions`: target name -> the layout convention its transform applied (a layout
      preset's, e.g. "flax Dense kernel (in, out) -> Linear weight (out, in)", or the
      reshape of a saved tensor that differs only in size-1 axes).
    """

    path: str
    taken: dict[str, str]
    cast: dict[str, tuple[np.dtype, np.dtype]]
    kept: list[str]
    unused: list[str]
    problems: list[str]
    call: str = "restore_checkpoint"
    transformed: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    conventions: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether the restore would succeed (no problems). One thing only the restore
        can tell, since a plan reads no tensor data: whether the saved value of a Python
        scalar leaf (an `int`, `float` or `bool` in a dict, list or tuple) converts exactly,
        as it must (0.5 into a `bool` is refused, naming the leaf)."""
        return not self.problems

    def __str__(self) -> str:
        rows = [("target", "saved", "")]
        for name, saved in self.taken.items():
            actions = []
            if name in self.transformed:
                before, after = self.transformed[name]
                actions.append(f"transformed {before} -> {after}")
                if name in self.conventions:
                    actions[-1] += f" ({self.conventions[name]})"
            if name in self.cast:
                before, after = self.cast[name]
                actions.append(f"cast {before} -> {after}")
            if not actions:
                actions.append("taken" if saved == name else "taken, renamed")
            rows.append((name, saved, ", ".join(actions)))
        rows += [(name, "-", "kept (target's value)") for name in self.kept]
        rows += [("-", name, "unused") for name in self.unused]
        width = [max(len(row[i]) for row in rows) for i in range(2)]
        verdict = "would succeed" if self.ok else f"would fail ({len(self.problems)} problems)"
        call = "restore" if self.call == "restore_checkpoint" else self.call
        lines = [f"{call} from {self.path} {verdict}:"]
        lines += [f"  {a:<{width[0]}}  {b:<{width[1]}}  {c}".rstrip() for a, b, c in rows]
        if self.problems:
            lines.append("problems:")
            lines += [f"  {problem}" for problem in self.problems]
        return "\n".join(lines)


def plan_restore(
    ckpt_dir: str | os.PathLike[str],
    target: Any,
    *,
    step: _names.Step | None = None,
    prefix: str = "checkpoint_",
    strict: bool = True,
    rename: _matching.Rename = None,
    casting: _matching.Casting = "no",
    filter_spec: Any = None,
    storage_options: Mapping[str, Any] | None = None,
    config: _selection.Config = "target",
    transform: _transform.Transform = None,
) -> RestorePlan:
    """What `restore_checkpoint(ckpt_dir, target, ...)` with the same arguments would do,
    read from the checkpoint's headers only (no tensor data), by the restore's own
    matcher.

    **Arguments:**

    - `ckpt_dir`, `step`, `prefix`, `storage_options`: which checkpoint, as for
      `restore_checkpoint`: any layout it reads (a Hugging Face directory, `model.safetensors`
      or index included), and a flax msgpack or Orbax path, planned as
      `load_flax_checkpoint` / `load_orbax_checkpoint` would load it (`RestorePlan.call`).
    - `target`: the pytree a restore would fill (arrays or `jax.ShapeDtypeStruct`s), or
      None: every tensor taken as saved (then `rename`, `casting` and `filter_spec`,
      which apply to a target's leaves, are refused).
    - `strict`, `rename`, `casting`, `filter_spec`, `config`, `transform`: as for
      `restore_checkpoint`. Each transform is evaluated with `jax.eval_shape` on the saved
      tensor's shape and dtype, so the plan knows its output without reading data.

    **Returns:**

    A `RestorePlan`: `taken`, `cast`, `transformed`, `kept`, `unused`, `problems`, `ok`;
    print it for a table. Its `problems` are the lines the restore's error would list.

    **Raises:**

    `FileNotFoundError` if there is no checkpoint to plan for (where a restore would return
    `target` unchanged); `ValueError` for a missing `step`; `CheckpointFormatError` for a
    checkpoint whose headers are not valid.
    """
    with calling("plan_restore"):
        options = RestoreOptions(
            strict=strict,
            rename=rename,
            casting=casting,
            filter_spec=filter_spec,
            config=config,
            transform=transform,
        ).check(target)
        store, where = _locations.resolve(ckpt_dir, storage_options)
        return _plan(store, where, ckpt_dir, target, step, prefix, options)


def _plan(
    store: Any,
    where: str,
    ckpt_dir: Any,
    target: Any,
    step: Any,
    prefix: str,
    options: RestoreOptions,
) -> RestorePlan:
    """The plan of the checkpoint `where` in `store` names (`ckpt_dir` as the user gave it)."""
    try:
        entry, _ = _restore._resolve(store, where, step, prefix)
        if entry is None:
            raise StepNotFoundError(f"{call()}: no checkpoint at {ckpt_dir} (prefix '{prefix}').")
        call_name, reader = "restore_checkpoint", _restore.open_reader(store, entry)
    except _layouts.ForeignCheckpointError as error:
        foreign = _layouts.foreign_reader(error.kind, error.path, prefix)
        if foreign is None:
            raise
        call_name, reader = foreign
    with reader:
        if target is None:  # the restore loads every tensor as saved
            names = {n: n for n in reader.arrays()}
            return RestorePlan(reader.path, names, {}, [], [], [], call_name)
        found = _matching.match(reader, target, options)
        return RestorePlan(
            reader.path,
            dict(found.taken),
            dict(found.cast),
            list(found.kept),
            list(found.unused),
            list(found.problems),
            call_name,
            dict(found.transformed),
            dict(found.conventions),
        )
