"""A fault-injecting HTTP/1.1 proxy on 127.0.0.1, put in front of the test S3 server to show
what a flaky network does to a client: a response lost after the server handled the request
(the client then retries on its own), or a store that stops answering.

    with FaultProxy(server.endpoint_url) as proxy:
        options = {**server.storage_options, "client_kwargs": {"endpoint_url": proxy.url, ...}}
        proxy.drop_response(lambda r: r.method == "PUT" and "index" in r.path)
        ...  # the next matching request reaches the server; its answer never comes back
        proxy.log  # every request seen: Request(method, path, query, headers), and its fate

Rules are tried in order on each request; a matching rule with uses left decides its fate:

- `drop_response`: forward the request, read the server's whole answer, then close the
  client's connection without sending it (the write happened; the client cannot know).
- `stall`: never forward, never answer; the connection is held open until `release()` or
  `close()` (a store that accepts connections and then freezes).
- `slow`: forward and answer, but only after `delay_s` (a store that answers slowly but
  steadily: each request alone is well within the client's timeouts).

With `rate_bytes_per_s`, the proxy is also a host's network link: requests (up) and answers
(down) each pass at most that many bytes a second, all connections together, as through
one full-duplex link; `bytes_up` and `bytes_down` count every byte that went through
(heads and bodies), so a benchmark can put one proxy in front of each process and read
exactly what each sent and fetched.

Loopback only, and bounded: the listener binds 127.0.0.1, every socket has a timeout, a
stalled connection is released after `max_stall_s` at the latest, and `close()` ends every
thread it started.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Request:
    method: str
    path: str  # URL-decoded, without the query
    query: str
    headers: dict[str, str]
    fate: str = "forwarded"


@dataclass
class _Rule:
    action: str
    matches: Callable[[Request], bool]
    times: int
    hits: list[Request] = field(default_factory=list)
    delay_s: float = 0.0


class _Link:
    """One direction of a link of `rate` bytes a second, shared by every connection: each
    chunk waits until the chunks before it would have passed at that rate."""

    def __init__(self, rate: float | None, closing: threading.Event):
        self.rate = rate
        self.total = 0
        self._closing = closing
        self._lock = threading.Lock()
        self._free_at = time.monotonic()

    def send(self, sock: socket.socket, data: bytes, chunk: int = 128 << 10) -> None:
        for start in range(0, len(data), chunk):
            piece = data[start : start + chunk]
            if self.rate is not None:
                with self._lock:
                    now = time.monotonic()
                    # A sleep that overran (a busy machine) is made up by the next chunks,
                    # up to a 50 ms burst, so the average rate holds.
                    self._free_at = max(now - 0.05, self._free_at) + len(piece) / self.rate
                    wait = self._free_at - now
                if self._closing.wait(wait):
                    raise OSError("the proxy is closing")
            sock.sendall(piece)
            with self._lock:
                self.total += len(piece)


class FaultProxy:
    """A loopback proxy to `target` (`http://127.0.0.1:PORT`); a context manager."""

    def __init__(
        self,
        target: str,
        *,
        max_stall_s: float = 60.0,
        io_timeout_s: float = 60.0,
        rate_bytes_per_s: float | None = None,
    ):
        parsed = urllib.parse.urlsplit(target)
        if parsed.hostname not in ("127.0.0.1", "localhost") or parsed.scheme != "http":
            raise ValueError(f"FaultProxy only fronts a plain-http loopback server, got {target}")
        self.target = ("127.0.0.1", parsed.port or 80)
        self.max_stall_s = max_stall_s
        self.io_timeout_s = io_timeout_s
        self.log: list[Request] = []
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self._released = threading.Event()
        self._closing = threading.Event()
        self._up = _Link(rate_bytes_per_s, self._closing)
        self._down = _Link(rate_bytes_per_s, self._closing)
        self._threads: list[threading.Thread] = []
        self._sockets: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._start(self._accept_loop)

    @property
    def bytes_up(self) -> int:
        """Bytes forwarded to the server so far (request heads and bodies)."""
        return self._up.total

    @property
    def bytes_down(self) -> int:
        """Bytes sent back to clients so far (answer heads and bodies)."""
        return self._down.total

    # ---------------------------------------------------------------------------- faults

    def drop_response(self, matches: Callable[[Request], bool], times: int = 1) -> _Rule:
        """The next `times` requests that `matches` reach the server; their answers are lost."""
        return self._add("drop_response", matches, times)

    def stall(self, matches: Callable[[Request], bool] = lambda r: True, times: int = 10**9):
        """Requests that `matches` are held unanswered (the store froze) until `release()`."""
        self._released.clear()
        return self._add("stall", matches, times)

    def slow(
        self, delay_s: float, matches: Callable[[Request], bool] = lambda r: True, times=10**9
    ) -> _Rule:
        """Requests that `matches` are answered, each `delay_s` seconds late."""
        return self._add("slow", matches, times, delay_s)

    def release(self) -> None:
        """Ends every stall: held connections are closed, and no new request stalls."""
        with self._lock:
            self._rules = [r for r in self._rules if r.action != "stall"]
        self._released.set()

    def _add(
        self, action: str, matches: Callable[[Request], bool], times: int, delay_s: float = 0.0
    ) -> _Rule:
        rule = _Rule(action, matches, times, delay_s=delay_s)
        with self._lock:
            self._rules.append(rule)
        return rule

    def _fate(self, request: Request) -> tuple[str, float]:
        with self._lock:
            self.log.append(request)
            for rule in self._rules:
                if rule.times > len(rule.hits) and rule.matches(request):
                    rule.hits.append(request)
                    request.fate = rule.action
                    return rule.action, rule.delay_s
        return "forwarded", 0.0

    # ------------------------------------------------------------------------- plumbing

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closing.set()
        self._released.set()
        with self._lock:
            sockets = list(self._sockets)
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
        for thread in self._threads:
            thread.join(timeout=10)
        self._listener.close()

    def _start(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _track(self, s: socket.socket) -> socket.socket:
        s.settimeout(self.io_timeout_s)
        with self._lock:
            self._sockets.add(s)
        return s

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._start(self._serve, self._track(client))

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        upstream_reader = None  # opened with `upstream`
        reader = client.makefile("rb")
        try:
            while not self._closing.is_set():
                head = _read_head(reader)
                if head is None:
                    return
                request_line, headers, raw_head = head
                method, target, _ = request_line.split(" ", 2)
                parts = urllib.parse.urlsplit(target)
                request = Request(method, urllib.parse.unquote(parts.path), parts.query, headers)
                if headers.get("expect", "").lower() == "100-continue":
                    # Answered here, and not forwarded: the server then sends no interim answer.
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    raw_head = b"".join(
                        line + b"\r\n"
                        for line in raw_head.split(b"\r\n")[:-1]
                        if not line.lower().startswith(b"expect:")
                    )
                body = _read_body(reader, headers, method=None)
                fate, delay_s = self._fate(request)
                if fate == "stall":
                    self._released.wait(self.max_stall_s)
                    return
                if fate == "slow" and self._closing.wait(min(delay_s, self.max_stall_s)):
                    return
                if upstream is None:
                    upstream = self._track(socket.create_connection(self.target))
                    upstream_reader = upstream.makefile("rb")
                self._up.send(upstream, raw_head + body)
                answer = _read_head(upstream_reader)
                if answer is None:
                    return
                status_line, answer_headers, raw_answer = answer
                answer_body = _read_body(upstream_reader, answer_headers, method=method,
                                         status=int(status_line.split(" ", 2)[1]))  # fmt: skip
                if fate == "drop_response":
                    return  # the server did the work; the client never hears of it
                self._down.send(client, raw_answer + answer_body)
                if answer_headers.get("connection", "").lower() == "close":
                    return
        except (OSError, ValueError):
            return
        finally:
            for s in (client, upstream):
                if s is not None:
                    with contextlib.suppress(OSError):
                        s.close()
                    with self._lock:
                        self._sockets.discard(s)


def _read_head(reader) -> tuple[str, dict[str, str], bytes] | None:
    lines = []
    while True:
        line = reader.readline(65537)
        if not line:
            return None
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            break
    raw = b"".join(lines)
    text = raw.decode("latin-1").split("\r\n")
    headers = {}
    for item in text[1:]:
        if ":" in item:
            key, _, value = item.partition(":")
            headers[key.strip().lower()] = value.strip()
    return text[0], headers, raw


def _read_body(reader, headers: dict[str, str], *, method: str | None, status: int = 0) -> bytes:
    """The body that follows a head, as raw bytes (chunked bodies kept chunked)."""
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return b""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        out = []
        while True:
            size_line = reader.readline(65537)
            out.append(size_line)
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, up to the empty line
                    trailer = reader.readline(65537)
                    out.append(trailer)
                    if trailer in (b"\r\n", b"\n", b""):
                        return b"".join(out)
            out.append(reader.read(size + 2))
    length = headers.get("content-length")
    if length is not None:
        return reader.read(int(length))
    if method is None:  # a request without a length has no body
        return b""
    return reader.read()  # a response delimited by the connection's end
