"""`python -m eqx_train` / `eqx-train`: look inside checkpoints, check them, compare them,
and convert flax checkpoints, from the shell.

`inspect`, `verify` and `diff` read through the library's own readers (headers first, data
only when asked) and never start a JAX backend: they work on a login node with no
accelerator and start fast. Errors are one line on stderr naming the file, exit status 1
(2 for a malformed command line, as argparse does).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence

from ._cli_convert import run_convert_flax, run_convert_orbax
from ._cli_diff import run_diff
from ._cli_inspect import run_inspect, run_verify
from ._cli_open import CommandError, one_line


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _step(text: str) -> int | float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a step (a number >= 0), got {text!r}")
    return int(value) if value.is_integer() else value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eqx-train",
        description="Look inside, check, compare and convert eqx_train checkpoints.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        sub.add_argument(
            "--prefix",
            default="checkpoint_",
            help="checkpoint file name prefix in directories (default: checkpoint_)",
        )
        return sub

    sub = command(
        "inspect",
        "Show a checkpoint's step, metrics, metadata and tensors (reads headers only); "
        "for a directory of checkpoints, list them.",
    )
    sub.add_argument("path", help="a checkpoint file, .shards or Hugging Face directory")
    sub.add_argument(
        "--tree",
        action="store_true",
        help="list every full dotted name under each of its prefixes, with tensor counts "
        "(the names restore_checkpoint's rename= takes); a directory shows its latest",
    )
    sub.add_argument(
        "--best-metric",
        help="for a directory: the metric that ranks checkpoints, as CheckpointManager's "
        "best_metric (default: the only metric the checkpoints hold)",
    )
    sub.add_argument(
        "--mode",
        choices=("min", "max"),
        help="for a directory: whether lower (min, the default) or higher metrics are better",
    )
    _progress_option(sub, "the checkpoints of a directory as their headers are read")
    sub.set_defaults(run=run_inspect)
    sub = command("verify", "Check every tensor against its checksum; exit 1 on any mismatch.")
    sub.add_argument("path", help="a checkpoint, or a directory of checkpoints (all checked)")
    _progress_option(sub, "the bytes checked")
    sub.set_defaults(run=run_verify)
    sub = command("diff", "Compare two checkpoints tensor by tensor; exit 1 if they differ.")
    sub.add_argument("a", help="first checkpoint (a directory: its latest)")
    sub.add_argument("b", help="second checkpoint (a directory: its latest)")
    for name, text in (("atol", "absolute"), ("rtol", "relative, times |B|")):
        sub.add_argument(
            f"--{name}",
            type=_tolerance,
            default=0.0,
            help=f"{text} tolerance for float and complex tensors: elements with "
            "|A - B| <= atol + rtol * |B| count as equal (default 0: compare bits); "
            "integers and booleans always compare exactly",
        )
    sub.set_defaults(run=run_diff)
    sub = command(
        "convert-flax",
        "Convert flax msgpack checkpoints (one file, or a directory of <prefix><step> "
        "files) to eqx_train checkpoints in DST, keeping their steps.",
    )
    sub.add_argument("src", help="a flax checkpoint file or directory")
    sub.add_argument("dst", help="the eqx_train checkpoint directory to write")
    _step_option(sub, "a file whose name holds no step (<prefix><step>)")
    _progress_option(sub, "the bytes read and written")
    sub.set_defaults(run=run_convert_flax)
    sub = command(
        "convert-orbax",
        "Convert Orbax checkpoints (flax's default checkpoint_<step>/ directories, orbax "
        "CheckpointManager steps, or a directory of them: every step) to eqx_train "
        "checkpoints in DST, keeping their steps; nothing in DST is deleted.",
    )
    sub.add_argument("src", help="an Orbax checkpoint, CheckpointManager step, or run directory")
    sub.add_argument("dst", help="the eqx_train checkpoint directory to write")
    sub.add_argument(
        "--item",
        metavar="NAME",
        help="the CheckpointManager item to convert (when there are several)",
    )
    _step_option(
        sub,
        "a checkpoint whose directory name holds no step, such as the state/ or model/ of "
        "NNX's guide (Orbax's metadata keeps none)",
    )
    _progress_option(sub, "the bytes read and written")
    sub.set_defaults(run=run_convert_orbax)
    return parser


def _progress_option(sub: argparse.ArgumentParser, what: str) -> None:
    sub.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"show a progress bar of {what} on stderr, once the work has taken about a "
        "second (default: when stderr is a terminal)",
    )


def _step_option(sub: argparse.ArgumentParser, needed_for: str) -> None:
    sub.add_argument(
        "--step",
        type=_step,
        metavar="N",
        help="the step to save one checkpoint as (default: the step its name says); "
        f"needed for {needed_for}",
    )


def _quiet_closed_stdout() -> int:
    """After a write to a closed pipe (`eqx-train inspect ... | head`): nothing more goes to
    stdout, not even the interpreter's last flush, and the status is 141, as for `cat` or
    `grep` killed by SIGPIPE."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        status = args.run(args)
        sys.stdout.flush()  # a closed pipe is found here, not at the interpreter's exit
        return status
    except BrokenPipeError:
        return _quiet_closed_stdout()
    except (
        CommandError,
        OSError,
        ValueError,
        TypeError,
        NotImplementedError,
        ImportError,
    ) as error:
        text = one_line(error)
        # The library's errors name the call they come from, here the command itself.
        text = text.removeprefix(f"{args.command}: ")
        print(f"eqx-train {args.command}: {text}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
