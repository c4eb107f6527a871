"""`eqx-train convert-flax` and `eqx-train convert-orbax`: foreign checkpoints rewritten as
eqx_train checkpoints, step by step, never deleting what the destination holds."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from typing import Any

from ._cli_open import CommandError, flax_steps, one_line, show_progress
from ._progress import reporting
from .checkpoints.engine import CheckpointFormatError
from .interop import engine as interop


def run_convert_flax(args: argparse.Namespace) -> int:
    """`eqx-train convert-flax SRC DST`; returns 0."""
    from .interop import load_flax_checkpoint

    found = flax_steps(args.src, args.prefix)
    if os.path.isdir(args.src):
        _refuse_step_for_many(args, f"a directory of flax checkpoints ({len(found)})")
        return _convert_each([(step, path) for path, step in found], load_flax_checkpoint, args)
    ((path, named),) = found
    why = f"its name is not {args.prefix}<step>, and a flax file keeps no step"
    return _convert_each([(_one_step(path, named, why, args), path)], load_flax_checkpoint, args)


def _one_step(source: str, named: Any, why: str, args: argparse.Namespace) -> Any:
    """The step to save the one checkpoint `source` as: `--step`, else the step its name
    says (`named`); refuses to guess one when that is None (`why` says why)."""
    if args.step is not None:
        return args.step
    if named is None:
        raise CommandError(
            f"{source}: its step is unknown: {why}; pass the step to save it as with --step N"
        )
    return named


def _refuse_step_for_many(args: argparse.Namespace, what: str) -> None:
    if args.step is not None:
        raise CommandError(
            f"{args.src} is {what}, each converted as its own step; --step names the step of "
            "one checkpoint: leave it out, or pass one checkpoint"
        )


def _convert_each(
    found: list[tuple[Any, str]], load: Callable[[str], Any], args: argparse.Namespace
) -> int:
    """Loads each `(step, source)` in turn and saves it into DST as that step, after
    refusing (before writing anything) steps that are not newer than DST's."""
    from .checkpoints import available_steps, save_checkpoint

    held = (
        available_steps(args.dst, args.prefix, step_type=float) if os.path.isdir(args.dst) else []
    )
    if held and found[0][0] <= held[-1]:
        # Checkpoints are added in step order (a save with overwrite= would delete newer ones).
        raise CommandError(
            f"{args.dst} already holds step {held[-1]:g}; the steps to convert "
            f"({', '.join(str(step) for step, _ in found)}) must all be newer (resuming an "
            "interrupted conversion? its finished steps are valid: convert into a new DST "
            "and move them over, or pass the remaining checkpoints one by one)"
        )
    show = show_progress(args)
    for step, source in found:
        try:
            # One bar per checkpoint, for its reads and its write.
            with reporting(show, f"{os.path.basename(source.rstrip('/')) or source}"):
                tree = load(source)
                # Retention off: converting must never delete what DST already holds.
                written = save_checkpoint(
                    args.dst, tree, step, prefix=args.prefix, keep=2**62, progress=show
                )
        except (CheckpointFormatError, CommandError):
            raise
        except (OSError, ValueError, TypeError) as error:
            raise CommandError(f"{source}: {one_line(error)}") from error
        print(f"{source} -> {written}")
    return 0


# ------------------------------------------------------------------------------ convert-orbax


def run_convert_orbax(args: argparse.Namespace) -> int:
    """`eqx-train convert-orbax SRC DST`; returns 0."""
    from .interop import load_orbax_checkpoint

    if not os.path.lexists(args.src):
        raise CommandError(f"{args.src}: no such file or directory")
    _check_item(args.src, args.item)
    found = interop.orbax_steps_to_convert(args.src, args.item)
    kind, steps = interop.orbax_layout(args.src)
    if kind == "run":
        _refuse_step_for_many(args, f"a directory of Orbax steps ({len(steps)})")
        return _convert_each(found, load_orbax_checkpoint, args)
    ((step, directory),) = found  # Orbax's 0 stands for "no step in the names" too
    named = step if step != 0 or _names_step_zero(args.src, kind) else None
    why = (
        "neither its name nor a CheckpointManager step directory around it says one "
        "(<step> or <name>_<step>), and Orbax's metadata keeps none"
    )
    found = [(_one_step(args.src, named, why, args), directory)]
    return _convert_each(found, load_orbax_checkpoint, args)


def _names_step_zero(src: str, kind: str) -> bool:
    """Whether step 0 is what the names say (`checkpoint_0`, a `0/` step directory) rather
    than Orbax's stand-in for a directory named without a step (`state/`)."""
    directories = [src]
    parent = os.path.dirname(os.path.abspath(src))
    if kind == "checkpoint" and interop.orbax_layout(parent)[0] == "step":
        directories.append(parent)
    return any(
        re.fullmatch(r"(?:.*_)?0+", os.path.basename(os.path.abspath(d))) for d in directories
    )


def _check_item(src: str, item: str | None) -> None:
    """Refuses, in the command line's words, an `--item` that `src` does not have or needs."""
    kind, names = interop.orbax_layout(src)
    if kind == "run":
        for directory in names:
            _check_item(directory, item)
    elif kind == "checkpoint" and item is not None:
        raise CommandError(
            f"{src} is a single Orbax PyTree checkpoint, not a CheckpointManager step with "
            f"items; leave out --item {item}"
        )
    elif kind == "step" and item is None and len(names) > 1:
        raise CommandError(
            f"{src} holds several items ({', '.join(names)}); choose one with --item NAME"
        )
    elif kind == "step" and item is not None and item not in names:
        raise CommandError(
            f"{src} has no item {item!r}; its items are {', '.join(names)}: choose one with "
            "--item NAME"
        )


# ------------------------------------------------------------------------------ main
