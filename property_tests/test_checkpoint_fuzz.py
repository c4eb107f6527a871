"""Checkpoint files under attack: random valid checkpoints, then their bytes mutated.

The law, for every mutation: `restore_checkpoint(file, None)` and `restore_checkpoint(file,
original_tree)` each return the exact saved tree (bit for bit) or raise
`CheckpointFormatError`. Nothing else: no other exception, no hang, no memory blow-up.

Precision about "a valid different checkpoint". Every file records an xxh3 checksum of each
tensor (seeded by its dtype and shape) and of the tree description, and the checksum table
must name exactly the file's tensors. So no edit that keeps the checksum table can turn a
file into a different file that verifies: renaming a tensor, changing its dtype, shape or
offsets, or editing the tree all break a checksum. A target restore's "does not match the
target" `ValueError` is therefore acceptable only when the mutated file is valid on its own
(`restore_checkpoint(file, None)` succeeds), which with the checksum table present means
never. The one way out is to remove the checksum table (files written before checksums
existed have none, and still restore): such an *unauthenticated* file can be a valid
different checkpoint, so for it the law weakens to "a tree, `CheckpointFormatError`, or (into
a target) a `ValueError` naming the mismatch" -- still no other exception, hang or blow-up.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import textwrap
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from eqx_train import checkpoints
from eqx_train.checkpoints.format import _description, _format
from eqx_train.testing import assert_trees_equal, strategies as ets
from property_tests.expected import as_saved, dict_keys

CheckpointFormatError = checkpoints.CheckpointFormatError
CHECKSUMS_KEY = "eqx_train.checksums"
TREE_KEY = "eqx_train.tree"
EXAMPLE_DEADLINE_S = 20  # a restore of a file of a few KiB taking this long is a hang
MAX_RSS_GROWTH = 256 << 20  # the files are a few KiB; no mutation may cost more than this

# Every dtype the format stores (a test in tests/test_testing.py holds the two tables equal).
DTYPES = ets.DTYPES
DTYPE_CODES = sorted(_description.CODE_TO_DTYPE)


# ------------------------------------------------------------------------------ strategies


@st.composite
def raw_arrays(draw: st.DrawFn) -> np.ndarray:
    """Any dtype, any (possibly zero-size) shape, arbitrary bit patterns: NaN payloads,
    -0.0, float8 and bfloat16 oddities (bools are drawn as 0/1, the only valid bytes)."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3).map(tuple))
    size = int(np.prod(shape, dtype=np.int64))
    if dtype == np.bool_:
        values = draw(st.lists(st.booleans(), min_size=size, max_size=size))
        return np.array(values, np.bool_).reshape(shape)
    data = draw(st.binary(min_size=size * dtype.itemsize, max_size=size * dtype.itemsize))
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


python_scalars = st.one_of(
    st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False)
)
flat_trees = st.dictionaries(
    dict_keys, st.one_of(raw_arrays(), python_scalars), min_size=1, max_size=5
)
saved_trees = st.one_of(flat_trees, ets.pytrees(max_leaves=5))


def texts(max_size: int) -> st.SearchStrategy[str]:
    """Strings as JSON can spell them, including lone surrogates (`"\\ud800"` is valid JSON
    but cannot be encoded as UTF-8)."""
    return st.text(st.one_of(st.characters(), st.sampled_from("\ud800\udfff")), max_size=max_size)


# JSON values an edit may put anywhere in a header: odd types, huge and negative numbers,
# lone surrogates, deep nesting.
_json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 2**63, 2**64, 10**30, 1e308, -0.0, 0.5]),
    texts(8),
    st.sampled_from(["\ud800", "__metadata__", "F32", "array", "tensor", "\x00"]),
)
json_values = st.recursive(
    _json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(texts(6), inner, max_size=3)
    ),
    max_leaves=8,
)


def deep(depth: int, where: str) -> str:
    """A placeholder that `join` replaces by `depth` levels of nesting: raw JSON in the header
    ("header"), or a nested tree description inside the tree's JSON string ("tree")."""
    return f"@@deep-{where}-{depth}@@"


def _expand_deep(raw: str) -> str:
    def header(match: re.Match) -> str:
        depth = int(match[1])
        return "[" * depth + "0" + "]" * depth

    def tree(match: re.Match) -> str:
        depth = int(match[1])
        return '{\\"list\\":[' * depth + '{\\"tensor\\":\\"x\\"}' + "]}" * depth

    raw = re.sub(r'"@@deep-header-(\d+)@@"', header, raw)
    return re.sub(r"@@deep-tree-(\d+)@@", tree, raw)


# ------------------------------------------------------------------------------ file bytes


def split(data: bytes) -> tuple[dict[str, Any], bytes]:
    """(header, data section) of a well-formed file, read by the safetensors spec."""
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def join(header: Any, body: bytes) -> bytes:
    """A file with `header` re-encoded, padded as the writer pads, with the right length."""
    raw = _expand_deep(json.dumps(header, separators=(",", ":"))).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return len(raw).to_bytes(8, "little") + raw + body


def authenticated(data: bytes) -> bool:
    """False only for a file whose header parses and carries no checksum table: no
    `__metadata__` at all (a plain safetensors file), or one without the table (then it can
    be a valid different checkpoint; see the module docstring). A `__metadata__` that is not
    an object is malformed, so that file stays under the strict law."""
    try:
        length = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + length])
    except (ValueError, RecursionError):
        return True
    if not isinstance(header, dict):
        return True
    metadata = header.get("__metadata__", {})
    return not isinstance(metadata, dict) or CHECKSUMS_KEY in metadata


@st.composite
def header_edits(draw: st.DrawFn, header: dict[str, Any]) -> dict[str, Any]:
    """One edit of a parsed header (whose `__metadata__` is a dict) that keeps it valid JSON."""
    header = json.loads(json.dumps(header))
    metadata = header["__metadata__"]
    names = [k for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    options = ["metadata_add", "any_node", "deep_header"]
    options += ["metadata_value", "metadata_delete"] if metadata else []
    options += ["tree"] if isinstance(metadata.get(TREE_KEY), str) else []
    options += ["checksum_digit"] if _checksum_table(metadata) else []
    if names:
        options += ["rename", "dtype", "shape", "offsets", "delete_tensor", "swap_offsets"]
    edit = draw(st.sampled_from(options))
    name = draw(st.sampled_from(names)) if names else ""
    if edit == "rename":
        new = draw(st.one_of(texts(6), st.sampled_from(names + ["__metadata__"])))
        header[new] = header.pop(name)
    elif edit == "dtype":
        header[name]["dtype"] = draw(st.one_of(st.sampled_from(DTYPE_CODES), json_values))
    elif edit == "shape":
        header[name]["shape"] = draw(
            st.one_of(st.lists(st.integers(-2, 2**65), max_size=4), json_values)
        )
    elif edit == "offsets":
        header[name]["data_offsets"] = draw(
            st.one_of(st.lists(st.integers(-2, 2**65), max_size=3), json_values)
        )
    elif edit == "swap_offsets":
        a, b = header[name], header[draw(st.sampled_from(names))]
        a["data_offsets"], b["data_offsets"] = b.get("data_offsets"), a.get("data_offsets")
    elif edit == "delete_tensor":
        del header[name]
    elif edit == "metadata_value":
        key = draw(st.sampled_from(sorted(metadata)))
        metadata[key] = draw(st.one_of(texts(20), key_edits(metadata[key]), json_values))
    elif edit == "metadata_delete":
        del metadata[draw(st.sampled_from(sorted(metadata)))]
    elif edit == "metadata_add":
        metadata[draw(texts(12))] = draw(texts(12))
    elif edit == "checksum_digit":  # one hex digit of any digest in the checksum table
        table = json.loads(metadata[CHECKSUMS_KEY])
        holder, key = draw(st.sampled_from(_digests(table)))
        old = holder[key]
        i = draw(st.integers(0, len(old) - 1))
        digit = draw(st.sampled_from("0123456789abcdef".replace(old[i], "")))
        holder[key] = old[:i] + digit + old[i + 1 :]
        metadata[CHECKSUMS_KEY] = json.dumps(table)
    elif edit == "tree":
        # Edit the tree description; half the time also drop the checksum table, so the
        # tree reaches the description validator instead of failing its checksum.
        choice = draw(st.sampled_from(["replace", "node", "deep"]))
        if choice == "deep":
            metadata[TREE_KEY] = deep(draw(st.integers(1, 50_000)), "tree")
        else:
            try:
                tree = json.loads(metadata[TREE_KEY])
            except ValueError:
                tree = None
            new = draw(json_values) if choice == "replace" else mutate_json(tree, draw)
            metadata[TREE_KEY] = json.dumps(new)
        if draw(st.booleans()):
            metadata.pop(CHECKSUMS_KEY, None)
    elif edit == "any_node":
        header = mutate_json(header, draw)
    else:  # deep_header
        key = draw(st.sampled_from([*names, "__metadata__", "x"]))
        header[key] = deep(draw(st.integers(1, 200_000)), "header")
    return header


def _digests(node: Any) -> list[tuple[Any, Any]]:
    """(container, key) of every 16-hex-digit string in a parsed checksum table."""
    found = []
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in items:
        if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{16}", value):
            found.append((node, key))
        elif isinstance(value, dict | list):
            found += _digests(value)
    return found


def _checksum_table(metadata: dict[str, Any]) -> bool:
    """Whether `metadata` holds a parseable checksum table with at least one digest."""
    try:
        table = json.loads(metadata.get(CHECKSUMS_KEY, ""))
    except (TypeError, ValueError):
        return False
    return isinstance(table, dict | list) and bool(_digests(table))


def key_edits(text: Any) -> st.SearchStrategy[str]:
    """`text` with one character inserted (possibly a lone surrogate)."""
    text = text if isinstance(text, str) else ""
    return st.tuples(st.integers(0, len(text)), texts(1).filter(bool)).map(
        lambda edit: text[: edit[0]] + edit[1] + text[edit[0] :]
    )


def mutate_json(value: Any, draw: st.DrawFn) -> Any:
    """`value` with one randomly chosen node (possibly the root) replaced by a random value."""
    if isinstance(value, dict) and value and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(value)))
        return {**value, key: mutate_json(value[key], draw)}
    if isinstance(value, list) and value and draw(st.booleans()):
        i = draw(st.integers(0, len(value) - 1))
        return [*value[:i], mutate_json(value[i], draw), *value[i + 1 :]]
    return draw(json_values)


@st.composite
def byte_mutations(draw: st.DrawFn, data: bytes) -> bytes:
    kinds = ["flip", "flip_header", "truncate", "append", "length"] if data else ["append"]
    kind = draw(st.sampled_from(kinds))
    if kind in ("flip", "flip_header"):
        header_end = 8 + int.from_bytes(data[:8].ljust(8, b"\0"), "little")
        end = min(header_end, len(data)) if kind == "flip_header" else len(data)
        i = draw(st.integers(0, end - 1))
        mask = draw(st.integers(1, 255))
        return data[:i] + bytes([data[i] ^ mask]) + data[i + 1 :]
    if kind == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))]
    if kind == "append":
        return data + draw(st.binary(min_size=1, max_size=64))
    length = draw(st.one_of(st.integers(0, len(data) + 16), st.integers(0, 2**64 - 1)))
    return (length.to_bytes(8, "little") + data[8:])[: max(len(data), 8)]


# ------------------------------------------------------------------------------ the law


class _Hang(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: float):
    """Raises `_Hang` in the test if the block runs longer than `seconds` (SIGALRM also
    interrupts a blocking open or read)."""

    def on_alarm(signum, frame):
        raise _Hang(f"a restore ran for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _outcome(path: str, target: Any) -> tuple[str, Any]:
    """("tree", result) | ("format", error) | ("mismatch", error); anything else propagates
    and fails the test."""
    try:
        return "tree", checkpoints.restore_checkpoint(path, target)
    except CheckpointFormatError as error:
        return "format", error
    except ValueError as error:
        if target is not None and "does not match the target" in str(error):
            return "mismatch", error
        raise


def check_law(saved: Any, mutated: bytes) -> None:
    peak_before = _max_rss()
    rss_before = _rss() if os.path.exists("/proc/self/statm") else peak_before
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "mutated.safetensors")
        with open(path, "wb") as f:
            f.write(mutated)
        with deadline(EXAMPLE_DEADLINE_S):
            as_none = _outcome(path, None)
            # (A saved tree of None is its own target: restoring into None is as_none.)
            into_target = as_none if saved is None else _outcome(path, saved)
    for _, error in (as_none, into_target):
        if isinstance(error, ValueError):
            assert len(str(error)) < 2000, f"error message of {len(str(error))} characters"
            assert path in str(error), f"the error does not name the file: {error}"
    assert as_none[0] != "mismatch"
    if into_target[0] == "mismatch":
        # Only a file that is valid on its own can be a *different* checkpoint.
        assert as_none[0] == "tree", f"corrupt file reported as a target mismatch: {into_target}"
    if authenticated(mutated):
        if as_none[0] == "tree":
            assert_trees_equal(as_none[1], as_saved(saved))
        if into_target[0] == "tree":
            assert_trees_equal(into_target[1], saved)
    elif into_target[0] == "tree" and saved is not None:  # unauthenticated: target structure
        assert jax.tree.structure(into_target[1]) == jax.tree.structure(saved)
    # The process's high-water mark may only have risen to MAX_RSS_GROWTH above the memory
    # in use before the restores (a peak from earlier tests is not this example's).
    assert _max_rss() <= max(peak_before, rss_before + MAX_RSS_GROWTH)


def saved_bytes(tree: Any) -> bytes:
    with tempfile.TemporaryDirectory() as directory:
        path = checkpoints.save_checkpoint(directory, tree, 7)
        with open(path, "rb") as f:
            return f.read()


# ------------------------------------------------------------------------------ tests

# Each example costs a few milliseconds, so the mutation tests run 4x the profile's count
# under `ci` (100: the whole file stays under 30 s) and 10x under `thorough` (5000 each).
fuzz = settings(
    max_examples=settings().max_examples
    * (10 if os.environ.get("HYPOTHESIS_PROFILE") == "thorough" else 4)
)


@fuzz
@given(tree=saved_trees, data=st.data())
def test_byte_mutations_give_saved_tree_or_format_error(tree, data):
    original = saved_bytes(tree)
    mutated = original
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        mutated = data.draw(byte_mutations(mutated), label="mutation")
    check_law(tree, mutated)


@fuzz
@given(tree=saved_trees, data=st.data())
def test_header_edits_give_saved_tree_or_format_error(tree, data):
    header, body = split(saved_bytes(tree))
    for _ in range(data.draw(st.integers(1, 2), label="edits")):
        edited = data.draw(header_edits(header), label="edit")
        if not isinstance(edited, dict) or not isinstance(edited.get("__metadata__"), dict):
            break
        header = edited
    else:
        edited = header
    check_law(tree, join(edited, body))


@fuzz
@given(tree=saved_trees, data=st.data())
def test_header_edit_then_byte_mutation_gives_saved_tree_or_format_error(tree, data):
    header, body = split(saved_bytes(tree))
    edited = join(data.draw(header_edits(header), label="edit"), body)
    check_law(tree, data.draw(byte_mutations(edited), label="mutation"))


@given(tree=flat_trees, data=st.data())
def test_unmutated_and_padding_only_changes_restore_exactly(tree, data):
    """The oracle's other side: mutations that change nothing the format reads (trailing
    bytes, header whitespace) must not be refused -- a reader that refuses everything would
    pass every test above."""
    original = saved_bytes(tree)
    header, body = split(original)
    raw = json.dumps(header, separators=(", ", ": ")).encode()  # extra spaces, same JSON
    raw += b"\n" * (-(8 + len(raw)) % 8)
    respaced = len(raw).to_bytes(8, "little") + raw + body
    extra = data.draw(st.binary(max_size=32), label="appended")
    for variant in (original, respaced, original + extra):
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "same.safetensors")
            with open(path, "wb") as f:
                f.write(variant)
            assert_trees_equal(checkpoints.restore_checkpoint(path, None), as_saved(tree))
            assert_trees_equal(checkpoints.restore_checkpoint(path, tree), tree)


# --------------------------------------------------- regression tests for what the fuzzer found


def _file_with(tree: Any, edit) -> bytes:
    header, body = split(saved_bytes(tree))
    edit(header)
    return join(header, body)


def _drop_checksums_and_edit_tree(fn):
    def edit(header):
        metadata = header["__metadata__"]
        del metadata[CHECKSUMS_KEY]
        metadata[TREE_KEY] = json.dumps(fn(json.loads(metadata[TREE_KEY])))

    return edit


def _set_entry(**fields):
    def fn(tree):
        tree["dict"][0][1].update(fields)
        return tree

    return fn


@pytest.mark.parametrize(
    "fields",
    [
        {"kind": ["array"]},  # unhashable kind: TypeError
        {"kind": "prng_key", "impl": "threefry2x32"},  # float data as a key: TypeError
        {"kind": "prng_key", "impl": "no_such_impl"},  # unknown impl: plain ValueError
    ],
    ids=["unhashable-kind", "prng-key-of-floats", "unknown-prng-impl"],
)
def test_crafted_tree_entry_in_file_without_checksums_is_a_format_error(fields):
    tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    check_law(tree, _file_with(tree, _drop_checksums_and_edit_tree(_set_entry(**fields))))


def test_module_node_with_repeated_field_is_a_format_error_not_a_lost_tensor():
    """A dict entry with a repeated key is refused; a module node's repeated field must be
    too, or `target=None` silently drops one of the file's tensors."""
    tree = {"a": np.zeros(2, np.float32), "b": np.ones(2, np.float32)}

    def fn(description):
        (_, a), (_, b) = description["dict"]
        return {"node": "Module", "children": [["a", a], ["a", b]]}

    path_bytes = _file_with(tree, _drop_checksums_and_edit_tree(fn))
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "dup.safetensors")
        with open(path, "wb") as f:
            f.write(path_bytes)
        with pytest.raises(CheckpointFormatError, match="repeat"):
            checkpoints.restore_checkpoint(path, None)


def test_zero_size_tensor_with_a_huge_dimension_is_a_format_error():
    """A zero-size tensor holds no bytes whatever its other dimensions, so [0, 2**65] passes
    the byte-range check; allocating it then raises NumPy's own ValueError ("Maximum allowed
    dimension exceeded"), not CheckpointFormatError."""
    tree = {"w": np.zeros((0,), np.float32)}

    def edit(header):
        header["w"]["shape"] = [0, 2**65]

    check_law(tree, _file_with(tree, edit))


def test_lone_surrogate_in_tree_description_is_a_format_error():
    """JSON may spell a lone surrogate ("\\ud800"); hashing the tree description then
    raised UnicodeEncodeError, even for a file with checksums."""
    tree = {"w": np.arange(3, dtype=np.float32)}

    def edit(header):
        header["__metadata__"][TREE_KEY] += "\ud800"

    check_law(tree, _file_with(tree, edit))


@pytest.mark.parametrize("field, value", [("dtype", "I32"), ("shape", [3, 2])])
def test_checksummed_header_edit_into_target_is_a_format_error_not_a_mismatch(field, value):
    """The checksum is seeded by dtype and shape, so a file whose header says I32 where the
    data was saved as F32 is corrupt, not a different checkpoint: restoring it into the
    original target must say so (CheckpointFormatError), not blame the target."""
    tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}

    def edit(header):
        header["w"][field] = value

    check_law(tree, _file_with(tree, edit))


# ------------------------------------------------------------------------------ memory


_RSS_PROBE = textwrap.dedent(
    """
    import resource, sys, tempfile
    import numpy as np
    from eqx_train import checkpoints

    def rss():
        # The peak RSS of this process. ru_maxrss survives exec on Linux (it starts at the
        # forking parent's peak, here the whole pytest process), so read VmHWM, which is
        # per address space, where the kernel offers it.
        try:
            with open("/proc/self/status") as f:
                line = next(l for l in f if l.startswith("VmHWM:"))
            return int(line.split()[1]) * 1024
        except OSError:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    with tempfile.TemporaryDirectory() as d:  # warm up the whole restore path first
        checkpoints.save_checkpoint(d, {"w": np.zeros(3)}, 1)
        checkpoints.restore_checkpoint(d, None)
    baseline = rss()
    try:
        checkpoints.restore_checkpoint(sys.argv[1], None)
        print("RESULT restored", baseline, rss(), 0)
    except checkpoints.CheckpointFormatError as error:
        print("RESULT refused", baseline, rss(), len(str(error)))
        print(str(error)[:300])
    """
)


def _restore_in_subprocess(path: str) -> tuple[str, int, int, int]:
    """(outcome, peak RSS after imports and a warm-up restore, peak RSS after the restore,
    length of the error message), from a fresh interpreter."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE, path],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-3000:]
    outcome, baseline, peak, message = lines[0].split()[1:]
    print(done.stdout)
    return outcome, int(baseline), int(peak), int(message)


def _write_header_file(path: str, parts: list[bytes]) -> int:
    """Writes `[8-byte length][parts...]` without joining the parts; returns the length."""
    length = sum(map(len, parts))
    with open(path, "wb") as f:
        f.write(length.to_bytes(8, "little"))
        for part in parts:
            f.write(part)
    return length


@pytest.mark.slow
def test_95_mib_header_is_refused_short_and_without_reading_it(tmp_path):
    """Issue 11 item 8: a ~95 MiB header once cost 2.8 GB of RSS and a 130 MB message. The
    length field alone says it is over the cap, so the reader must refuse before reading:
    the bound is an eighth of the header (reading it even once would cost 1x)."""
    entry = b'"t%09d":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},'
    per_block = 10_000
    blocks = (95 << 20) // (len(entry % 0) * per_block)
    parts = [b'{"__metadata__":{}']
    for block in range(blocks):
        start = block * per_block
        parts.append(b"," + b"".join(entry % i for i in range(start, start + per_block))[:-1])
    parts.append(b"}")
    path = str(tmp_path / "huge_header.safetensors")
    length = _write_header_file(path, parts)
    del parts
    outcome, baseline, peak, message = _restore_in_subprocess(path)
    print(f"{length / 2**20:.1f} MiB header: baseline {baseline >> 20} MiB, peak {peak >> 20} MiB")
    assert outcome == "refused"
    assert message < 500
    assert peak - baseline < length // 8


# Headers just under the cap, each the densest of its kind: ~11 million empty JSON objects
# ("{}," costs ~80 bytes as a Python dict), and ~6.7 million 2-character strings ('"ab",',
# ~60 bytes each; scalars are not containers, so no container-density check refuses them).
JUST_UNDER_THE_CAP = {
    "tiny-objects": (b'{"__metadata__":{},"x":[', b"{},", b"{}]}"),
    "short-strings": (b'{"__metadata__":{},"x":[', b'"ab",', b'"ab"]}'),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(JUST_UNDER_THE_CAP))
def test_header_just_under_the_cap_has_bounded_memory(tmp_path, kind):
    """The cap (`MAX_HEADER_BYTES`) is what bounds a hostile header's memory: whatever the
    reader does with such a header, the growth must stay under 1.5 GiB and the file is
    refused with a short message. Measured at 7d337b3 (Linux, CPython 3.11, 164 MiB after
    imports): tiny-objects +32 MiB (refused by the density check before parsing; +869 MiB,
    ~27x, before that check existed), short-strings +559 MiB (~17x the header)."""
    cap = _format.MAX_HEADER_BYTES
    prefix, unit, suffix = JUST_UNDER_THE_CAP[kind]
    count = (cap - len(prefix) - len(suffix)) // len(unit)
    path = str(tmp_path / f"{kind}.safetensors")
    length = _write_header_file(path, [prefix, unit * count, suffix])
    assert cap - len(unit) < length <= cap  # just under the cap: read, not refused by size
    outcome, baseline, peak, message = _restore_in_subprocess(path)
    growth = (peak - baseline) >> 20
    print(f"{kind}: {length / 2**20:.1f} MiB header: peak {peak >> 20} MiB (+{growth} MiB)")
    assert outcome == "refused"
    assert message < 500
    assert peak - baseline < 1536 << 20
