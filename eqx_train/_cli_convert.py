"""`eqx-train convert-flax` and `eqx-train convert-orbax`: foreign checkpoints rewritten as
eqx_train checkpoints, step by step, never deleting what the destination holds."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from ._cli_open import CommandError, flax_steps, one_line
from .checkpoints.engine import CheckpointFormatError
from .interop import engine as interop


def run_convert_flax(args: argparse.Namespace) -> int:
    """`eqx-train convert-flax SRC DST`; returns 0."""
    from .interop import load_flax_checkpoint

    found = [(step, path) for path, step in flax_steps(args.src, args.prefix)]
    return _convert_each(found, load_flax_checkpoint, args)


def _convert_each(
    found: list[tuple[Any, str]], load: Callable[[str], Any], args: argparse.Namespace
) -> int:
    """Loads each `(step, source)` in turn and saves it into DST as that step."""
    from .checkpoints import save_checkpoint

    for step, source in found:
        try:
            tree = load(source)
            # Retention off: converting must never delete what DST already holds.
            written = save_checkpoint(args.dst, tree, step, prefix=args.prefix, keep=2**62)
        except (CheckpointFormatError, CommandError):
            raise
        except (OSError, ValueError, TypeError) as error:
            raise CommandError(f"{source}: {one_line(error)}") from error
        print(f"{source} -> {written}")
    return 0


# ------------------------------------------------------------------------------ convert-orbax


def run_convert_orbax(args: argparse.Namespace) -> int:
    """`eqx-train convert-orbax SRC DST`; returns 0."""
    from .checkpoints import available_steps
    from .interop import load_orbax_checkpoint

    if not os.path.lexists(args.src):
        raise CommandError(f"{args.src}: no such file or directory")
    found = interop.orbax_steps_to_convert(args.src, args.item)
    held = (
        available_steps(args.dst, args.prefix, step_type=float) if os.path.isdir(args.dst) else []
    )
    if held and found[0][0] <= held[-1]:
        # Checkpoints are added in step order: refuse before writing anything.
        raise CommandError(
            f"{args.dst} already holds step {held[-1]:g}; the steps to convert "
            f"({', '.join(str(step) for step, _ in found)}) must all be newer (resuming an "
            "interrupted conversion? its finished steps are valid: convert into a new DST "
            "and move them over, or pass the remaining step directories one by one)"
        )
    return _convert_each(found, load_orbax_checkpoint, args)


# ------------------------------------------------------------------------------ main
