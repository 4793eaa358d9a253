"""One HTTP request to a reward server with an overall deadline and a byte cap on its answer.

httpx's timeouts are per operation: its read timeout restarts with every byte that arrives, so a server that sends
its headers and then one byte every half second (a stuck proxy, an overloaded vLLM) is never timed out, and an
answer of any size is read whole. Here `timeout_s` bounds the whole exchange, from the start of the connection
(connecting, sending the request, receiving the status line, the headers and the whole body), and at most
`max_bytes` of the body are read.

How: every request opens its own connection (no keep-alive), the `trace` extension hands over its socket as soon as
it is connected, and a timer shuts that socket down when the deadline passes, which wakes a blocked read or write
in the requesting thread; the exchange then fails as DeadlinePassed, an httpx.TimeoutException, so callers retry it
like any other timeout. Waiting for a free connection of the client's pool is not counted: it says nothing about
the server, and concurrent batches that share one client queue there.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import httpx


class DeadlinePassed(httpx.TimeoutException):
    """No complete answer within the request's overall deadline."""


@dataclass
class Answer:
    """status, headers, body (b"" when not read) and, when the body was not read, why (too large, compressed)."""

    status: int
    headers: httpx.Headers
    body: bytes
    not_read: str | None = None

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


def make_client(max_connections: int) -> httpx.Client:
    """A client for `request`: no kept-alive connections, because the deadline is armed when a connection is made
    (a pooled one would carry no fresh socket to hand over)."""
    return httpx.Client(limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=0))


class _Watchdog:
    """Shuts the request's socket down at its deadline; `fired` says whether it did."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.started: float | None = None
        self.sockets: list[socket.socket] = []
        self.timer: threading.Timer | None = None
        self.fired = False
        self.done = False

    def trace(self, event: str, info: dict) -> None:
        if event == "connection.connect_tcp.started":
            self.started = time.monotonic()
        elif event in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
            # TLS wraps the TCP socket into a new object that owns the descriptor: both are kept, one of them works
            stream = info.get("return_value")
            sock = stream.get_extra_info("socket") if stream is not None else None
            if sock is None:
                return
            with self.lock:
                if self.done:
                    return
                self.sockets.append(sock)
                if self.timer is None:
                    left = (self.started or time.monotonic()) + self.timeout_s - time.monotonic()
                    self.timer = threading.Timer(max(left, 0.0), self._fire)
                    self.timer.daemon = True
                    self.timer.start()

    def _fire(self) -> None:
        with self.lock:
            if self.done:
                return
            self.fired = True
            for sock in self.sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:  # already closed, or a TLS socket's detached original
                    pass

    def passed(self) -> bool:
        return self.fired or (self.started is not None and time.monotonic() - self.started > self.timeout_s)

    def disarm(self) -> None:
        with self.lock:
            self.done = True
            if self.timer is not None:
                self.timer.cancel()


def _read_capped(resp: httpx.Response, cap: int, watchdog: _Watchdog) -> tuple[bytes, str | None]:
    """(body, None), or (b"", why) when the body is over `cap` bytes: refused from its Content-Length unread, or
    as soon as more than `cap` bytes have arrived, so that a runaway server costs at most `cap` bytes of memory."""
    encoding = resp.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        # the cap counts decoded bytes, and one compressed chunk decodes whole: 60 KB of gzip is 60 MB in memory
        # before any count, nested encodings far more. The request asks for none; one sent anyway is refused
        return b"", f"answer body sent with Content-Encoding {encoding!r}, which was not asked for; not read"
    declared = resp.headers.get("content-length", "").strip()
    if declared.isdigit() and int(declared) > cap:
        return b"", f"answer body of {int(declared)} bytes (its Content-Length) is over the {cap}-byte cap; not read"
    body = bytearray()
    for chunk in resp.iter_raw():
        body += chunk
        if len(body) > cap:
            return b"", (f"answer body over the {cap}-byte cap: {len(body)} bytes had arrived when reading stopped"
                         f"{'' if declared else ' (no Content-Length)'}")
        if watchdog.passed():  # a chunk that arrived just as the socket was shut down
            raise DeadlinePassed(f"no complete answer within {watchdog.timeout_s}s")
    return bytes(body), None


def request(client: httpx.Client, method: str, url: str, *, timeout_s: float, max_bytes: int,
            headers: dict[str, str] | None = None, json=None) -> Answer:
    """One exchange, bounded by timeout_s overall and max_bytes of answer body. Raises DeadlinePassed (an
    httpx.TimeoutException) past the deadline, and httpx's TransportError for a refused or dropped connection."""
    watchdog = _Watchdog(timeout_s)
    headers = {**(headers or {}), "Accept-Encoding": "identity"}  # see _read_capped
    try:
        with client.stream(method, url, json=json, headers=headers, timeout=httpx.Timeout(timeout_s, pool=None),
                           extensions={"trace": watchdog.trace}) as resp:
            body, not_read = _read_capped(resp, max_bytes, watchdog)
            return Answer(resp.status_code, resp.headers, body, not_read)
    except httpx.TransportError as e:
        if watchdog.fired and not isinstance(e, DeadlinePassed):
            raise DeadlinePassed(f"no complete answer within {timeout_s}s") from e
        raise
    finally:
        watchdog.disarm()


def get(url: str, *, timeout_s: float, max_bytes: int, headers: dict[str, str] | None = None) -> Answer:
    """One bounded GET on a client of its own (health checks)."""
    with make_client(1) as client:
        return request(client, "GET", url, timeout_s=timeout_s, max_bytes=max_bytes, headers=headers)
