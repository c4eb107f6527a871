"""A `CheckpointManager`'s local tier: each process's units in its own `local_directory`,
copied to `peer_replicas` other processes over the interconnect, and the restore that
picks the newest step whose every unit some process holds, verified
(see [Checkpoint tiers](../checkpoint_tiers.md)).

Process `i`'s unit is kept by processes `(i + k) % n` for `k = 1 .. peer_replicas`, so
losing any `peer_replicas` hosts leaves a copy of every unit.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal

import jax

from ..._calls import call, in_context, outside_stacklevel
from .._errors import CheckpointFormatError, UnreadableCheckpointWarning
from ..format import _names
from ..pipeline import _coordination, _directory, _local_tier, _peers
from ..storage import _locations

HOST_STATE_KEY = _names.HOST_STATE_KEY
Tier = Literal["local", "peer", "persistent"]


@dataclass(frozen=True)
class LastRestore:
    """What the last `CheckpointManager.restore` of this process did.

    **Arguments:**

    - `step`: the step restored (`None`: there was no checkpoint, the target came back).
    - `tier`: where this process's state came from: `"local"` (its own local directory),
      `"peer"` (another process's copy of its unit, sent over the interconnect) or
      `"persistent"` (the manager's `directory`); `None` with no checkpoint.
    - `seconds`: how long the restore took, choice and reads included.
    - `bytes_read`: the bytes this process read per tier (`"local"`, `"peer"`,
      `"persistent"`); the tiers not read from are absent.
    - `host_state`: the `host_state` this process saved with that step (`None` if none).
    """

    step: int | float | None
    tier: Tier | None
    seconds: float
    bytes_read: dict[str, int] = field(default_factory=dict)
    host_state: Any = None


def encode_host_states(host_state: Any, *, timeout_s: float) -> str:
    """Every process's `host_state`, as the JSON list that a persistent checkpoint keeps
    (one exchange in a multi-process job: call it on every process)."""
    mine = _local_tier.host_state_json(host_state)
    values = _coordination.gather(_coordination.next_id("host_state"), mine, timeout_s=timeout_s)
    return "[" + ",".join(values) + "]"


def host_state_of(metadata: dict[str, str]) -> Any:
    """This process's `host_state` in a persistent checkpoint's metadata (None if none)."""
    raw = metadata.get(HOST_STATE_KEY)
    if raw is None:
        return None
    values = json.loads(raw)
    me = jax.process_index()
    return values[me] if isinstance(values, list) and me < len(values) else None


def persistent_report(
    entry: Any, metadata: dict[str, str] | None, tree: Any, began: float
) -> LastRestore:
    """`last_restore` for a restore of `entry` (a listed persistent checkpoint, None for
    none) whose header holds `metadata`, into `tree`."""
    seconds = time.perf_counter() - began
    if entry is None or metadata is None:
        return LastRestore(None, None, seconds)
    # An empty `metadata`: the checkpoint was deleted (retention) after it was read.
    return LastRestore(
        step=entry.step,
        tier="persistent",
        seconds=seconds,
        bytes_read={"persistent": _held_bytes(tree)},
        host_state=host_state_of(metadata),
    )


def _held_bytes(tree: Any) -> int:
    """The bytes of the leaves this process holds: each distinct block of an array once."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            blocks = {str(shard.index): shard.data.nbytes for shard in leaf.addressable_shards}
            total += sum(blocks.values())
        elif hasattr(leaf, "nbytes"):
            total += int(leaf.nbytes)
    return total


class LocalTier:
    """This process's local tier: its saves (async when the manager's are) and the restore
    across the processes' local tiers."""

    def __init__(
        self,
        local_directory: str,
        *,
        prefix: str,
        keep: int,
        replicas: int,
        interval: int | None,
        timeout_s: float,
        async_save: bool,
    ):
        self.store, self.directory = _locations.resolve(local_directory)
        self.store.makedirs(self.directory)
        self.prefix, self.keep, self.interval = prefix, keep, interval
        self.replicas = min(replicas, jax.process_count() - 1)
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(1, "eqx_train-local") if async_save else None
        self._pending: Future[None] | None = None
        self.last_step: Decimal | None = None
        self._read: dict[str, _local_tier.Unit] = {}  # own units verified by a restore

    @classmethod
    def of(cls, options: Any) -> LocalTier | None:
        """The local tier a manager's checked `ManagerOptions` describe (None for none)."""
        if options.local_directory is None:
            return None
        return cls(
            options.local_directory,
            prefix=options.prefix,
            keep=options.local_keep_latest,
            replicas=options.peer_replicas,
            interval=options.local_interval_steps,
            timeout_s=options.timeout_s,
            async_save=options.async_save,
        )

    def due(self, value: Decimal) -> bool:
        """Whether the local interval asks for a save at `value` (never twice a step)."""
        if self.interval is None or (self.last_step is not None and value <= self.last_step):
            return False
        return value == value.to_integral_value() and int(value) % self.interval == 0

    # ------------------------------------------------------------------ saving

    def save(self, step: Any, state: Any, host_state: Any) -> None:
        """Copies this process's part of `state` to the host, sends it to its peers, then
        writes its unit and the peers' (in the background for an async manager)."""
        self.wait()
        me, count = jax.process_index(), jax.process_count()
        data = _local_tier.encode(_local_tier.capture(state), step, me, count, host_state)
        units = {me: data}
        if self.replicas:
            sizes_op = _coordination.next_id("local_sizes")
            sizes = [
                int(s)
                for s in _coordination.gather(sizes_op, str(len(data)), timeout_s=self.timeout_s)
            ]
            for shift in range(1, self.replicas + 1):
                got = _peers.shift_bytes(data, shift, sizes)
                if got is None:  # pragma: no cover - every process sends its unit
                    raise RuntimeError(f"{call()}: process {me} received no peer unit")
                units[(me - shift) % count] = got
        self.last_step = _names.check_step(step)
        write = in_context(lambda: self._write(step, units, count))
        if self._pool is None:
            write()
        else:
            self._pending = self._pool.submit(write)

    def _write(self, step: Any, units: dict[int, bytes], count: int) -> None:
        directory = _local_tier.step_dir(self.store, self.directory, self.prefix, step)
        failure: BaseException | None = None
        try:
            for owner, data in units.items():
                self.store.makedirs(directory)
                _local_tier.write_unit(
                    self.store, directory, _local_tier.unit_name(owner, count), data
                )
        except BaseException as error:
            failure = error
        outcome = "ok" if failure is None else f"failed: {failure!r}"
        outcomes = _coordination.gather(
            _coordination.next_id("local_commit"), outcome, timeout_s=self.timeout_s
        )
        if failure is not None:
            raise failure
        if all(o == "ok" for o in outcomes):
            # Older steps go once every process holds this one, so a kill mid-save never
            # leaves the job with no complete local step.
            _local_tier.prune(self.store, self.directory, self.prefix, self.keep)

    def wait(self) -> None:
        """Blocks until the background write (if any) is done; raises its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    # ------------------------------------------------------------------ restoring

    def restore(
        self, target: Any, persistent_latest: Decimal | None, began: float
    ) -> tuple[Any, LastRestore] | None:
        """`target` filled from the newest step complete across the processes' local tiers
        (and not older than `persistent_latest`), with what happened; `None` when there is
        none, or when some process could not restore it (then every process returns None).
        Call it on every process."""
        me, count = jax.process_index(), jax.process_count()
        self._read = {}
        try:
            return self._restore(target, persistent_latest, began, me, count)
        finally:
            self._read = {}

    def _restore(
        self, target: Any, persistent_latest: Decimal | None, began: float, me: int, count: int
    ) -> tuple[Any, LastRestore] | None:
        valid = self._verified(count)
        mine = {f"{h.text}/{h.owner}": h.size for h in valid}
        views = [
            json.loads(v)
            for v in _coordination.gather(
                _coordination.next_id("local_held"), json.dumps(mine), timeout_s=self.timeout_s
            )
        ]
        chosen = _choose(views, count, persistent_latest)
        if chosen is None:
            return None
        text, holders = chosen
        own = {h.owner: h for h in valid if h.text == text}
        outcome, result = "ok", None
        try:
            received = self._exchange(text, holders, own, views, me, count)
            result = self._place(target, text, own, received, me, count, began)
        except (CheckpointFormatError, _local_tier.LocalCopyMismatch, OSError) as error:
            outcome = f"failed: {error}"
        outcomes = _coordination.gather(
            _coordination.next_id("local_restored"), outcome, timeout_s=self.timeout_s
        )
        failed = [f"process {i}: {o}" for i, o in enumerate(outcomes) if o != "ok"]
        if failed:
            warnings.warn(
                f"{call()}: the local tiers' step {text} could not be restored "
                f"({'; '.join(failed)}); restoring from the persistent tier instead.",
                UnreadableCheckpointWarning,
                stacklevel=outside_stacklevel(sys._getframe()),
            )
            return None
        return result

    def _verified(self, count: int) -> list[_local_tier.Held]:
        """The units of this job's process count that read and verify; each corrupt one is
        moved aside to `corrupt-<its name>`, with a warning naming it."""
        valid = []
        for held in _local_tier.scan(self.store, self.directory, self.prefix):
            if held.count != count:
                continue  # another process count's layout: never restored from
            try:
                unit = self._read.get(held.path) or _local_tier.read_unit(self.store, held)
                if held.owner == jax.process_index():
                    self._read[held.path] = unit  # read once: kept for the restore
            except (CheckpointFormatError, OSError) as error:
                aside = held.path.rpartition("/")
                self.store.move(held.path, f"{aside[0]}/corrupt-{aside[2]}")
                warnings.warn(
                    f"{call()}: skipped the corrupt local-tier copy {held.path} ({error}); "
                    f"moved it aside to corrupt-{aside[2]}.",
                    UnreadableCheckpointWarning,
                    stacklevel=outside_stacklevel(sys._getframe()),
                )
                continue
            valid.append(held)
        return valid

    def _exchange(
        self,
        text: str,
        holders: dict[int, int],
        own: dict[int, _local_tier.Held],
        views: list[dict[str, int]],
        me: int,
        count: int,
    ) -> int:
        """Sends the units their owners lack, over the interconnect; each owner writes what
        it receives as its own unit. Returns the bytes this process received."""
        transfers = {(q, p) for p, q in holders.items() if q != p}
        received = 0
        for shift in sorted({(p - q) % count for q, p in transfers}):
            sizes = []
            for i in range(count):
                p = (i + shift) % count
                sizes.append(views[i][f"{text}/{p}"] if (i, p) in transfers else -1)
            payload = None
            if sizes[me] >= 0:
                held = own[(me + shift) % count]
                source = self.store.open(held.path)
                try:
                    buffer = bytearray(held.size)
                    source.read_into(memoryview(buffer), 0)
                finally:
                    source.close()
                payload = bytes(buffer)
            got = _peers.shift_bytes(payload, shift, sizes)
            if got is not None:
                received += len(got)
                directory = _local_tier.step_dir(
                    self.store, self.directory, self.prefix, _names.step_from_text(text)
                )
                path = _local_tier.write_unit(
                    self.store, directory, _local_tier.unit_name(me, count), got
                )
                own[me] = _local_tier.Held(_names.step_value(text), text, me, count, path, len(got))
        return received

    def _place(
        self,
        target: Any,
        text: str,
        own: dict[int, _local_tier.Held],
        received: int,
        me: int,
        count: int,
        began: float,
    ) -> tuple[Any, LastRestore]:
        held = own.get(me)
        if held is None:
            raise CheckpointFormatError(f"process {me}'s unit of step {text} never arrived")
        unit = self._read.get(held.path) or _local_tier.read_unit(self.store, held)
        restored = _local_tier.place(unit, target)
        jax.block_until_ready(restored)
        tier: Tier = "peer" if received else "local"
        report = LastRestore(
            step=_names.step_from_text(text),
            tier=tier,
            seconds=time.perf_counter() - began,
            bytes_read={tier: held.size},
            host_state=unit.host_state,
        )
        return restored, report


def _choose(
    views: list[dict[str, int]], count: int, persistent_latest: Decimal | None
) -> tuple[str, dict[int, int]] | None:
    """The newest step whose every unit some process holds, and which process sends each
    owner its unit (the owner itself where it holds it); None when no step is complete or
    the persistent tier has a newer one."""
    holders: dict[str, dict[int, list[int]]] = {}
    for process, view in enumerate(views):
        for key in view:
            text, _, owner = key.partition("/")
            holders.setdefault(text, {}).setdefault(int(owner), []).append(process)
    for text in sorted(holders, key=_names.step_value, reverse=True):
        if persistent_latest is not None and _names.step_value(text) < persistent_latest:
            return None
        found = holders[text]
        if set(found) == set(range(count)):
            return text, {p: (p if p in found[p] else min(found[p])) for p in found}
    return None


class Tiers:
    """The tiers' half of `CheckpointManager`: which tiers a save writes, the restore from
    the local tiers, and `last_restore`. The manager inherits it."""

    _local: LocalTier | None
    _due: tuple[Any, bool, bool] | None
    _last_restore: LastRestore | None
    _restored: _directory.Entry | None

    def _latest(self) -> Decimal | None:
        raise NotImplementedError

    def _listing(self) -> list[_directory.Entry]:
        raise NotImplementedError

    def _header(self, entry: _directory.Entry) -> dict[str, str]:
        raise NotImplementedError  # a listed checkpoint's metadata

    @property
    def last_restore(self) -> LastRestore | None:
        """What the last `restore` through this manager did on this process (`None` before
        the first): the step, the tier it came from (`"local"`, `"peer"`,
        `"persistent"`), its seconds, the bytes read per tier and the `host_state` saved
        with it."""
        return self._last_restore

    def _tiers_due(self, step: Any) -> tuple[bool, bool]:
        """(the persistent tier, the local tier): which `save(step)` writes."""
        if self._local is None:
            return True, False
        due, self._due = self._due, None
        if due is None or due[0] != _names.check_step(step):
            return True, True  # a save no should_save asked for: both tiers
        return due[1], due[2] or due[1]

    def _restore_local(self, target: Any, began: float) -> tuple[bool, Any]:
        """(True, the tree) restored from the local tiers, or (False, None) when they hold
        no complete step as new as the persistent tier's newest."""
        if self._local is None:
            return False, None
        restored = self._local.restore(target, self._latest(), began)
        if restored is None:
            return False, None
        tree, self._last_restore = restored
        return True, tree

    def _persistent_report(self, tree: Any, target: Any, step: Any, began: float) -> LastRestore:
        """`last_restore` for a restore from the persistent tier (`directory`)."""
        entry = self._restored
        if entry is None and tree is not target:
            listing = self._listing()
            value = None if step is None or step == "best" else _names.check_step(step)
            entry = (
                _directory.latest(listing)
                if value is None
                else _directory.find_step(listing, value)
            )
        metadata = None
        if entry is not None:
            try:
                metadata = self._header(entry)
            except (OSError, CheckpointFormatError):  # pruned (or damaged) since it was read
                metadata = {}
        return persistent_report(entry, metadata, tree, began)
