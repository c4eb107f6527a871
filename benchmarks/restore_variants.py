"""What a restore's speed depends on, measured by switching one thing at a time in one process:
how a tensor still on the disk is read, verification, and the host window.

On the default device (a GPU where there is one), float32 states of random values:

- `--mib` MiB in `--leaves` leaves, restored from a cold page cache (where
  `/proc/sys/vm/drop_caches` is writable: root) as eqx_train does it (a tensor still on the
  disk read whole), as if it were all in memory (a tensor over `_part_reads.SPLIT_BYTES`
  in parts read at once, as before that rule), and as a raw read + `device_put` of the
  same bytes; and from the page cache;
- `--big-mib` MiB in `--leaves` leaves from the page cache: as it is, with `verify=False`
  (what checking every tensor's checksum costs), with each group's checksums checked as it
  is read rather than while its transfers run (`_read.CHECK_WHILE_PLACING`), with each
  tensor read whole rather than in spans of its parts (`_pieces`; what the spans gain when
  a leaf is as large as the window), and from a file written with one digest per tensor
  (before format version 3: one xxh3 stream per tensor, at one core's speed). Twice the
  default window was measured on an H200 too: 1.03 and 1.04 s against 0.87 and 0.90 s as
  it is (tensors past the pinned arena come from pageable memory), so it is no longer a
  variant.

Variants are interleaved (the order rotated every round); medians of `--rounds`:

    python benchmarks/restore_variants.py --mib 2048 --big-mib 8192 --out DIR
    python benchmarks/restore_variants.py --mib 256 --big-mib 512 --leaves 8  # a CPU check

Writes `restore_variants.json` (every sample) to `--out` after every sample, so a run cut
short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
from gpu_checkpoints import (  # noqa: E402
    drop_caches,
    eqx_sync,
    fresh_dir,
    make_state,
    raw_restore,
    raw_sync,
)

from eqx_train import checkpoints  # noqa: E402
from eqx_train.checkpoints.format import _checksums  # noqa: E402
from eqx_train.checkpoints.format._reader import FileReader  # noqa: E402
from eqx_train.checkpoints.pipeline import _read  # noqa: E402
from eqx_train.checkpoints.storage._local_files import LocalSource  # noqa: E402


class Samples:
    def __init__(self, out: str) -> None:
        self.samples: dict[str, list[float]] = {}
        self.path = os.path.join(out, "restore_variants.json")
        os.makedirs(out, exist_ok=True)

    def time(self, name: str, restore: Callable[[], Any]) -> None:
        start = time.perf_counter()
        jax.block_until_ready(restore())
        seconds = time.perf_counter() - start
        self.samples.setdefault(name, []).append(round(seconds, 4))
        print(f"{name}: {seconds:.3f} s", flush=True)
        with open(self.path, "w") as f:
            json.dump({"samples": self.samples, "medians": self.medians()}, f, indent=1)

    def medians(self) -> dict[str, float]:
        return {k: round(statistics.median(v), 4) for k, v in self.samples.items()}


def rotated(names: list[str], round_: int) -> list[str]:
    k = round_ % len(names)
    return names[k:] + names[:k]


def cold_and_warm(samples: Samples, base: str, mib: int, leaves: int, rounds: int) -> None:
    directory = fresh_dir(base, "state")
    state = make_state(mib, leaves, 1)
    eqx_sync(state, directory)
    raw_sync(state, directory)
    del state
    target = make_state(mib, leaves, 2)
    real = LocalSource.cached

    def eqx(in_parts: bool) -> Callable[[], Any]:
        def restore() -> Any:
            LocalSource.cached = (lambda self, offset, length: True) if in_parts else real
            try:
                return checkpoints.restore_checkpoint(directory, target)
            finally:
                LocalSource.cached = real

        return restore

    variants = {
        "cold: eqx_train": eqx(False),
        "cold: in parts, as if in memory": eqx(True),
        "cold: raw read + device_put": lambda: raw_restore(target, directory),
    }
    cold = drop_caches()
    for round_ in range(rounds):
        for name in rotated(list(variants), round_) if cold else []:
            drop_caches()
            samples.time(f"{mib} MiB, {name}", variants[name])
        samples.time(f"{mib} MiB, warm: eqx_train", eqx(False))
        samples.time(f"{mib} MiB, warm: checked before placing", checked_before(eqx(False)))
    if not cold:
        print("no cold restores: the page cache cannot be dropped here (root only)")
    shutil.rmtree(directory, ignore_errors=True)


def checked_before(restore: Callable[[], Any]) -> Callable[[], Any]:
    """`restore` with each group checked as it is read, before its transfers start."""

    def before() -> Any:
        _read.CHECK_WHILE_PLACING = False
        try:
            return restore()
        finally:
            _read.CHECK_WHILE_PLACING = True

    return before


def whole_tensors(restore: Callable[[], Any]) -> Callable[[], Any]:
    """`restore` reading every tensor whole, none in spans (`_pieces`): a tensor as large as
    the window is then read, sent, and only then followed by the next."""

    def whole() -> Any:
        spans = FileReader.spans
        FileReader.spans = lambda self, name, max_bytes: None  # type: ignore[method-assign]
        try:
            return restore()
        finally:
            FileReader.spans = spans  # type: ignore[method-assign]

    return whole


def big(samples: Samples, base: str, mib: int, leaves: int, rounds: int) -> None:
    directory, single = fresh_dir(base, "big"), fresh_dir(base, "single")
    state = make_state(mib, leaves, 3)
    eqx_sync(state, directory)
    part_bytes, _checksums.PART_BYTES = _checksums.PART_BYTES, 1 << 62
    try:  # one digest per tensor, as before format version 3
        eqx_sync(state, single)
    finally:
        _checksums.PART_BYTES = part_bytes
    del state
    target = make_state(mib, leaves, 4)
    restore = partial(checkpoints.restore_checkpoint, directory, target)
    variants: dict[str, Callable[[], Any]] = {
        "as it is": restore,
        "verify=False": partial(restore, verify=False),
        "checked before placing": checked_before(restore),
        "each tensor whole": whole_tensors(restore),
        "one digest per tensor": partial(checkpoints.restore_checkpoint, single, target),
    }
    for round_ in range(rounds):
        for name in rotated(list(variants), round_):
            samples.time(f"{mib} MiB, warm: {name}", variants[name])
    shutil.rmtree(directory, ignore_errors=True)
    shutil.rmtree(single, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--mib", type=int, default=2048)
    parser.add_argument("--big-mib", type=int, default=8192, help="0 skips the big state")
    parser.add_argument("--leaves", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT") or ".", help="report folder")
    parser.add_argument("--dir", default=None, help="where to write checkpoints (a temp dir)")
    args = parser.parse_args()
    samples = Samples(args.out)
    base = tempfile.mkdtemp(prefix="eqx_train_restore_variants_", dir=args.dir)
    device = jax.devices()[0]
    print(f"{device} ({device.device_kind}), JAX {jax.__version__}", flush=True)
    try:
        cold_and_warm(samples, base, args.mib, args.leaves, args.rounds)
        if args.big_mib:
            big(samples, base, args.big_mib, args.leaves, args.rounds)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps({"benchmark": "restore_variants", "medians": samples.medians()}))


if __name__ == "__main__":
    main()
