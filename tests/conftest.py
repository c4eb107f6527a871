"""The one place that configures JAX for the test suites (tests/ and property_tests/).

The suites run on 8 simulated CPU devices, so the multi-device code paths run on any
machine. Tests that start subprocesses give those their own environment.

XLA compiles with most of its optimisations off (`jax_disable_most_optimizations`, as JAX's
own test suite runs) and with XLA:CPU's older code emitters (`QUICK_XLA_FLAGS`), which
compile a small program in half the time: the suites run many small programs once each, so
compiling them took most of their CPU time, and both change what a program computes only in
rounding, the same on both sides of every comparison a test makes. The environment
(`JAX_DISABLE_MOST_OPTIMIZATIONS`, `XLA_FLAGS`) carries both to the processes tests start;
set `JAX_DISABLE_MOST_OPTIMIZATIONS=0` to test with XLA's defaults instead.

The run-time type checking (pyproject's `--jaxtyping-packages`) checks eqx_train's module
functions, classes and methods, not the functions defined inside a function's body: those
are decorated anew each time their outer function runs, and generating their checkers took
a third of the in-process suite's CPU time. None of them has an array annotation (a
jaxtyping shape, which only a run-time check can hold), and pyright checks them.
"""

import functools
import os
import signal
import subprocess
import sys
from typing import Any

import jax
import jaxtyping
import pytest

QUICK_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)
"""XLA flags for quick compilation, added to `XLA_FLAGS` where this XLA knows them (it aborts
the process on a flag it does not know, so a release that drops one must not break the
suites)."""


def _xla_knows(flags: tuple[str, ...]) -> bool:
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    check = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.run(check, env=env, capture_output=True, timeout=120).returncode == 0


os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
_QUICK = os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"].lower() in (
    "1",
    "y",
    "yes",
    "t",
    "true",
    "on",
)
jax.config.update("jax_disable_most_optimizations", _QUICK)
_xla_flags = os.environ.get("XLA_FLAGS", "").split()
_missing = tuple(f for f in QUICK_XLA_FLAGS if f.split("=")[0] not in " ".join(_xla_flags))
if _QUICK and _missing and _xla_knows(_missing):
    # Before JAX starts its CPU backend, which reads XLA_FLAGS once.
    os.environ["XLA_FLAGS"] = " ".join([*_xla_flags, *_missing])
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

_jaxtyped = jaxtyping.jaxtyped
_NO_FUNCTION = object()


@functools.wraps(_jaxtyped)
def _jaxtyped_unless_nested(fn: Any = _NO_FUNCTION, **options: Any) -> Any:
    if fn is _NO_FUNCTION:  # `@jaxtyped(typechecker=...)`, as the import hook writes it
        return functools.partial(_jaxtyped_unless_nested, **options)
    if "<locals>" in getattr(fn, "__qualname__", ""):
        return fn
    return _jaxtyped(fn, **options)


jaxtyping.jaxtyped = _jaxtyped_unless_nested


@pytest.fixture
def without_type_checks():
    """Turns off the suite's run-time type checking (pyproject's `--jaxtyping-packages`) for
    one test, as for a user who runs none: for tests of eqx_train's own errors on wrongly
    typed input, which the type checker would otherwise reject first."""
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", before)


@pytest.fixture
def interruptible():
    """Ctrl-C (SIGINT, or `_thread.interrupt_main()`) raises `KeyboardInterrupt` in the main
    thread for one test, however the suite was started: a shell's background job (CI runs a
    lane so) inherits SIGINT ignored, and then an interrupt would silently do nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-compatible server (SeaweedFS) on 127.0.0.1, one per test session.

    Yields a `tests.support.s3_server.SeaweedS3` with `.endpoint_url`, `.key`, `.secret`,
    `.storage_options` (for `s3fs.S3FileSystem` / fsspec) and `.env` (the AWS variables,
    for subprocesses). Its process is killed when the session ends, however it ends."""
    from tests.support.s3_server import SeaweedS3

    # Under pytest's temporary root, which pytest prunes, in case the session is killed
    # before it can remove the data itself.
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs")).start()
    try:
        yield server
    finally:
        server.stop(remove=True)


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh, empty bucket on `s3_server`, as a URL `s3://<name>`."""
    import secrets

    return s3_server.create_bucket(f"test-{secrets.token_hex(8)}")


@pytest.fixture
def proxied(s3_server, s3_bucket):
    """(URL of a fresh run on `s3_server`, storage_options that reach it through a
    `tests.support.fault_proxy.FaultProxy`, the proxy): for tests of lost and late answers."""
    from tests.support.fault_proxy import FaultProxy

    with FaultProxy(s3_server.endpoint_url, max_stall_s=30) as proxy:
        options = {
            **s3_server.storage_options,
            "client_kwargs": {"endpoint_url": proxy.url, "region_name": "us-east-1"},
        }
        yield f"{s3_bucket}/run", options, proxy


@pytest.fixture
def arena(monkeypatch):
    """CPU devices get a 4 MiB pinned arena (`pipeline._pinned`), as an accelerator's client
    does; returns the (address, bytes) each (recorded, fake) `dma_map` got. A CPU device
    adopts the host buffer it is placed from, so a block reused too early shows up as a
    wrong leaf: the failure the arena must never cause on a GPU."""
    from eqx_train.checkpoints.pipeline import _pinned

    mapped: list[tuple[int, int]] = []
    monkeypatch.setattr(_pinned, "eligible", lambda platform: True)
    monkeypatch.setattr(_pinned, "dma_map", lambda client, a, n: mapped.append((a, n)))
    monkeypatch.setattr(_pinned, "ARENA_BYTES", 4 << 20)
    monkeypatch.setattr(_pinned, "_arenas", {})
    return mapped
