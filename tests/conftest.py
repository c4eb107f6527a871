"""The one place that configures JAX for the test suites (tests/ and property_tests/).

The suites run on 8 simulated CPU devices, so the multi-device code paths run on any
machine. Tests that start subprocesses give those their own environment.
"""

import signal

import jax
import jaxtyping
import pytest

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)


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
