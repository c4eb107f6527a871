"""The checkpoint directory (local or an object-store prefix, through `_storage`): listing
in numeric order, retention, removal of only what this library wrote, and cleanup of what
dead writers left. Every name comes from `_names`; which pieces a `.shards` index cites,
from `_shards`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from ..._calls import call
from .._errors import StepExistsError
from ..format import _names, _shards
from ..format._reader import FileReader
from ..storage._base import Storage


@dataclass(frozen=True)
class Entry:
    """One committed checkpoint in a directory."""

    value: Decimal  # the step, exact
    text: str  # the step as spelled in the name
    path: str
    sharded: bool
    # The listed version (an ETag: of the file, or of a `.shards` index), where the store's
    # listing says; None locally.
    identity: Any = field(default=None, compare=False)

    @property
    def step(self) -> int | float:
        return _names.step_from_text(self.text)

    @property
    def layout(self) -> str:
        """How to read it (`_restore.open_reader`): "shards" or "file", known from its name."""
        return "shards" if self.sharded else "file"


def list_checkpoints(store: Storage, ckpt_dir: str, prefix: str) -> list[Entry]:
    """Every committed checkpoint of `prefix` in `ckpt_dir`, oldest step first.

    Counted: regular files `{prefix}{step}.safetensors` and directories
    `{prefix}{step}.shards` that hold their index. Anything else (notes, temporaries, other
    prefixes, a directory or FIFO under a checkpoint name) is ignored, and so never deleted.
    Among names of the same step (an older version spelled 1.0 what is now 1), the canonical
    spelling sorts last, so it is the one `[-1]` picks.
    """
    found: list[Entry] = []  # _LISTING_ATTEMPTS >= 1 scans replace it
    for _ in range(_LISTING_ATTEMPTS):
        found, vanished = _scan(store, ckpt_dir, prefix)
        if not vanished:
            break
        # A checkpoint was deleted while we looked (a concurrent save's retention): its
        # successor may be missing from this scan, so look again.
    found.sort(key=lambda e: (e.value, _names.is_canonical(e.text), e.sharded, e.text))
    return found


def _scan(store: Storage, ckpt_dir: str, prefix: str) -> tuple[list[Entry], bool]:
    pattern = _names.checkpoint_pattern(prefix)
    if not store.cheap_reads:
        # One listing of every key under the prefix, however many checkpoints: a `.shards`
        # checkpoint is committed when its index is among them.
        return [
            Entry(_names.step_value(match["step"]), match["step"], path, sharded, identity)
            for match, path, sharded, identity in _committed_objects(store, ckpt_dir, prefix)
        ], False
    found, vanished = [], False
    for item in store.list(ckpt_dir):
        match = pattern.fullmatch(item.name)
        if match is None:
            continue
        sharded = match["suffix"] == _names.SHARDED_SUFFIX
        if sharded:
            committed = item.is_dir and store.is_file(store.join(item.path, _names.INDEX_NAME))
        else:
            committed = item.is_file and store.is_file(item.path)
        if not committed:
            vanished = vanished or not store.exists(item.path)
            continue
        text = match["step"]
        found.append(Entry(_names.step_value(text), text, item.path, sharded))
    return found, vanished


def _committed_objects(
    store: Storage, ckpt_dir: str, prefix: str
) -> list[tuple[Any, str, bool, Any]]:
    """(name match, path, sharded, identity) of each committed checkpoint, from one
    `find`."""
    pattern = _names.checkpoint_pattern(prefix)
    found = []
    for item in store.find(ckpt_dir, prefix):
        first, _, rest = item.name.partition("/")
        match = pattern.fullmatch(first)
        if match is None:
            continue
        sharded = match["suffix"] == _names.SHARDED_SUFFIX
        if (rest == _names.INDEX_NAME) if sharded else not rest:
            found.append((match, store.join(ckpt_dir, first), sharded, item.identity))
    return found


def latest(listing: list[Entry]) -> Entry | None:
    return listing[-1] if listing else None


def find_step(listing: list[Entry], value: Decimal) -> Entry | None:
    """The preferred entry of step `value`, or None."""
    matches = [e for e in listing if e.value == value]
    return matches[-1] if matches else None


_LISTING_ATTEMPTS = 5
# Given the checkpoints (one entry per step, oldest first), the step texts to delete.
Retention = Callable[[list["Entry"]], list[str]]


def check_keep(keep: Any) -> None:
    if isinstance(keep, bool) or not isinstance(keep, int):
        raise TypeError(f"{call()}: keep must be an int >= 1, got {keep!r}.")
    if keep < 1:
        raise ValueError(f"{call()}: keep must be an int >= 1, got {keep!r}.")


def check_newer(
    store: Storage,
    ckpt_dir: str,
    prefix: str,
    value: Decimal,
    text: str,
    overwrite: bool,
) -> None:
    """Raises unless step `value` (spelled `text`) is newer than every checkpoint, or
    `overwrite`."""
    newest = latest(list_checkpoints(store, ckpt_dir, prefix))
    if newest is not None and not overwrite and value <= newest.value:
        raise StepExistsError(
            f"{call()}: a checkpoint at step {newest.text} already exists in {ckpt_dir} "
            f"and step {text} is not newer. Pass overwrite=True to replace it (this also "
            "deletes every newer checkpoint)."
        )


def check_keep_every_n_steps(value: Any) -> None:
    """Refuses a `keep_every_n_steps` that is neither None nor a positive number."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int | float) or not value > 0
    ):
        raise ValueError(
            f"{call()}: keep_every_n_steps must be a positive number or None, got {value!r}."
        )


def steps_to_delete(
    steps: list[tuple[Decimal, str]],
    *,
    keep: int,
    keep_every_n_steps: int | float | None,
) -> list[str]:
    """flax's retention rule: which of `steps` (oldest first) to delete.

    The newest `keep` are kept. Walking the older ones from the oldest, a step is also kept
    when `keep_every_n_steps` is set and the step is at least that far past the last step kept
    this way (starting from -inf). As in flax, step 0 is never kept by that second rule.
    """
    if len(steps) <= keep:
        return []
    doomed = []
    last_kept = Decimal("-Infinity")
    for value, text in steps[: len(steps) - keep]:
        if keep_every_n_steps and value and value - last_kept >= Decimal(str(keep_every_n_steps)):
            last_kept = value
            continue
        doomed.append(text)
    return doomed


def flax_retention(keep: Any, keep_every_n_steps: Any) -> Retention:
    """Validates `keep` / `keep_every_n_steps` and returns flax's retention rule for them."""
    check_keep(keep)
    check_keep_every_n_steps(keep_every_n_steps)

    def retention(entries: list[Entry]) -> list[str]:
        steps = [(e.value, e.text) for e in entries]
        return steps_to_delete(steps, keep=keep, keep_every_n_steps=keep_every_n_steps)

    return retention


def preferred(listing: list[Entry]) -> list[Entry]:
    """One entry per step, oldest first: of several spellings of a step, the one a listing
    prefers (its order puts that one last)."""
    return list({e.value: e for e in listing}.values())


def apply_retention(
    store: Storage,
    ckpt_dir: str,
    prefix: str,
    new_value: Decimal,
    just_written: str,
    *,
    overwrite: bool,
    retention: Retention,
) -> None:
    """After a commit: with `overwrite`, remove steps newer than the new one; remove other
    spellings of the new step; then the steps `retention` names. The checkpoint this save
    just wrote is never removed by it."""
    listing = list_checkpoints(store, ckpt_dir, prefix)
    doomed = [e for e in listing if e.value == new_value and e.path != just_written]
    if overwrite:
        doomed += [e for e in listing if e.value > new_value]
    live = [e for e in listing if e not in doomed]
    one_each = preferred(live)
    by_text = {e.text: e.value for e in one_each}
    values = {by_text[text] for text in retention(one_each)}
    doomed += [e for e in live if e.value in values]
    for entry in doomed:
        if entry.path != just_written:
            remove_checkpoint(store, entry)


def remove_checkpoint(store: Storage, entry: Entry) -> None:
    """Deletes a checkpoint: a file, or a `.shards` directory's index (which uncommits it
    first), then the files this library names there. A directory that still holds other
    files afterwards is left in place."""
    if not entry.sharded:
        store.remove(entry.path)
        return
    cited = _shards.referenced_pieces(store, entry.path, FileReader) or set()
    index = store.join(entry.path, _names.INDEX_NAME)
    store.remove(index)
    if store.exists(index):
        return  # still committed (the removal failed): its pieces must stay
    # Only the pieces the removed index cited: a concurrent save's new pieces are not ours.
    _shards.remove_paths(store, [store.join(entry.path, name) for name in sorted(cited)])
    clean_shards_dir(store, entry.path, keep_token=None)


def quarantine(store: Storage, ckpt_dir: str, entry: Entry) -> str:
    """Moves a checkpoint that was skipped as unreadable out of the listing, keeping it
    whole beside the others under `_names.quarantine_name`; returns its new path.

    Locally that is one rename (of the file or the `.shards` directory) that never replaces
    a name taken since it was checked (`LocalStorage.move`): the next name is tried. An
    object store has no rename: each object is copied and removed, a `.shards` index last,
    so that the checkpoint stays whole under one of its two names throughout (there the name
    is checked, then written: an object put under it in between would be replaced)."""
    name = entry.path.rstrip("/").replace("\\", "/").rsplit("/", 1)[-1]
    for attempt in range(1000):
        new_path = store.join(ckpt_dir, _names.quarantine_name(name, attempt))
        if store.exists(new_path):
            continue
        if entry.sharded and not store.atomic_rename:
            break  # moved object by object, below
        try:
            store.move(entry.path, new_path)
        except FileExistsError:  # the name was taken since it was checked: try the next
            continue
        return new_path
    else:  # pragma: no cover - a thousand quarantined copies of one name
        raise FileExistsError(f"{ckpt_dir} already holds 1000 quarantined copies of {name}")
    index = store.join(entry.path, _names.INDEX_NAME)
    names = sorted(item.name for item in store.list(entry.path) if item.is_file)
    for piece in [n for n in names if n != _names.INDEX_NAME] + [_names.INDEX_NAME]:
        source = index if piece == _names.INDEX_NAME else store.join(entry.path, piece)
        store.move(source, store.join(new_path, piece))
    return new_path


def remove_leftovers(
    store: Storage,
    ckpt_dir: str,
    prefix: str,
    *,
    keep_token: str | None = None,
    current: str | None = None,
) -> None:
    """Removes what dead writers of `prefix` left in `ckpt_dir`: temporary files of killed
    saves (on object stores: their unfinished uploads and the markers naming their
    writers), and in `.shards` directories the pieces and temporaries of saves that never
    committed (or were superseded). Only names this library makes, and only when the writer
    is known to be dead (see `_writer_is_dead`). `current` (the `.shards` directory a
    multi-process save is about to fill) is never removed, even while still empty."""
    pattern = _names.checkpoint_pattern(prefix)
    # Uploads before markers: a writer puts its marker before it starts its upload, so every
    # upload listed here has its marker in the listing that follows.
    uploads = store.unfinished_uploads(ckpt_dir)
    items = store.list(ckpt_dir)
    # What each `.shards` directory holds, from one listing: only one that holds more than
    # a committed save's own files is looked at more closely (an index read, a listing).
    contents: dict[str, list[str]] = {}
    for found in store.find(ckpt_dir, prefix):
        first, _, rest = found.name.partition("/")
        if rest:
            contents.setdefault(first, []).append(rest)
    now = time.time()
    writers: dict[str, list[bool]] = {}  # final name -> whether each marked writer is gone
    for item in items:
        temp = _names.parse_temp(item.name)
        if temp is not None:
            final, host, pid = temp
            if pattern.fullmatch(final):
                age = None if item.modified is None else now - item.modified
                writers.setdefault(final, []).append(_gone(store, host, pid, age))
            continue
        match = pattern.fullmatch(item.name)
        if match and match["suffix"] == _names.SHARDED_SUFFIX and item.is_dir:
            if item.path != current and _may_hold_litter(contents.get(item.name, [])):
                clean_shards_dir(store, item.path, keep_token=keep_token)
    kept = set()  # names with an upload still going (or not known to be dead)
    for upload in uploads:
        if _upload_is_litter(store, upload, pattern, keep_token, writers, now):
            store.abort_upload(ckpt_dir, upload)
        else:
            kept.add(upload.name)
    # Markers and temporaries go after the uploads they vouch for; a dead writer's marker
    # stays while an upload of its name does, to be recognised again once that one is over.
    for item in items:
        temp = _names.parse_temp(item.name)
        if temp is not None and pattern.fullmatch(temp[0]) and temp[0] not in kept:
            age = None if item.modified is None else now - item.modified
            if _gone(store, temp[1], temp[2], age):
                store.remove(item.path)


def _may_hold_litter(names: list[str]) -> bool:
    """Whether a `.shards` directory holding `names` may hold something to clean up: all
    but a committed checkpoint with its index and the pieces of one save."""
    if _names.INDEX_NAME not in names:
        return True
    tokens = set()
    for name in names:
        if name != _names.INDEX_NAME:
            parsed = _names.parse_piece_file(name)
            if parsed is None:
                return True  # a marker or a temporary file
            tokens.add(parsed[1])
    return len(tokens) > 1


def _upload_is_litter(
    store: Storage,
    upload: Any,
    pattern: Any,
    keep_token: str | None,
    writers: dict[str, list[bool]],
    now: float,
) -> bool:
    """Whether an unfinished upload under a checkpoint name of this prefix belongs to a
    writer that is gone. A piece's name carries its save's token (hence its writer); a
    single file's upload is vouched for by its writer's marker. Without any marker, only
    age tells (a writer killed between its marker and its upload, or another tool)."""
    first, _, rest = upload.name.partition("/")
    if not pattern.fullmatch(first):
        return False
    age = None if upload.started is None else now - upload.started
    if rest:
        parsed = _names.parse_piece_file(rest)
        if parsed is None or not parsed[1]:
            return _is_stale(store, age)
        token = parsed[1]
        return token != keep_token and _writer_is_dead(store, age, token)
    marked = writers.get(first)
    if marked:
        return all(marked)  # a live writer's marker: its upload may be this one
    return _is_stale(store, age)


def _gone(store: Storage, host: str, pid: int, age_s: float | None) -> bool:
    """Whether the writer `host`/`pid` of something `age_s` old is over. On this machine its
    process says so (however long a live writer takes); a writer elsewhere is presumed gone
    only once what it left is stale (object stores: no host owns them)."""
    if host == _names.host_id():
        return _names.writer_is_dead(host, pid)
    return _is_stale(store, age_s)


def _is_stale(store: Storage, age_s: float | None) -> bool:
    return store.stale_by_age and age_s is not None and age_s > STALE_S


def _writer_is_dead(store: Storage, item_age_s: float | None, token: str) -> bool:
    """Whether the save that wrote a piece named with `token` is over. On this machine, its
    process is gone. Elsewhere (object stores, which no host owns) liveness is unknowable;
    a piece that has waited `STALE_S` for its commit belongs to a save that timed out long
    ago (every wait of a multi-process save is bounded, 300 s by default)."""
    return _gone(store, *_names.token_writer(token), item_age_s)


STALE_S = 3600.0


def clean_shards_dir(store: Storage, path: str, *, keep_token: str | None) -> None:
    """In one `.shards` directory, removes the pieces and markers of saves other than
    `keep_token` that the index does not cite and whose writer is dead, and temporaries of
    dead writers. Removes the directory if it ends up empty and uncommitted."""
    items = store.list(path)
    protected = _shards.referenced_pieces(store, path, FileReader) or set()
    now = time.time()
    for item in items:
        name = item.name
        parsed = _names.parse_piece_file(name) or _names.parse_done_marker(name)
        if parsed is not None:
            token = parsed[1]
            if token and token != keep_token and name not in protected:
                age = None if item.modified is None else now - item.modified
                if _writer_is_dead(store, age, token):
                    store.remove(item.path)
            continue
        temp = _names.parse_temp(name)
        if temp is not None:
            age = None if item.modified is None else now - item.modified
            if _gone(store, temp[1], temp[2], age):
                store.remove(item.path)  # a temporary file, or an upload's marker
    _shards.remove_if_uncommitted_and_empty(store, path)
