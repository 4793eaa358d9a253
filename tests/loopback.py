"""A fake server on the loopback address for the reward clients' tests: a threaded HTTP server on 127.0.0.1 (a free
port) serving one handler class until closed, and never past max_seconds or max_requests, so that a test that
fails before closing it leaves nothing running."""

from __future__ import annotations

import threading
import time
from http.server import ThreadingHTTPServer


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # a client that hangs up on a slow or oversized answer is what these tests provoke


class LoopbackServer:
    """Serves `handler` (a BaseHTTPRequestHandler class) at `url` until `stop` is set or close() is called."""

    def __init__(self, handler, stop: threading.Event, max_seconds: float, max_requests: int | None = None):
        self.stop = stop
        self.server = _Server(("127.0.0.1", 0), handler)
        self.server.timeout = 0.05  # handle_request returns this often to look at stop and the deadline
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        deadline = time.monotonic() + max_seconds

        def loop():
            handled = 0
            while not stop.is_set() and time.monotonic() < deadline and (max_requests is None
                                                                          or handled < max_requests):
                self.server.handle_request()
                handled += 1
            self.server.server_close()

        self.thread = threading.Thread(target=loop, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
