"""A webhook receiver for tests: a real HTTP server on 127.0.0.1 in a thread.

It records every request (method, path, headers, body) and answers with ``status``
(plus ``location`` for redirects), over HTTPS when given a certificate. ``start()`` may
be called again after ``stop()`` on the same port, to play a receiver that was down and
came back.
"""

from __future__ import annotations

import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.stack import free_port


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    port: int = field(default_factory=free_port)
    status: int = 200
    location: str | None = None
    # (certificate, key) PEM files: serve HTTPS with them.
    tls: tuple[Path, Path] | None = None
    requests: list[Received] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook?src=test"

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with receiver._lock:
                    receiver.requests.append(Received(
                        "POST", self.path, {k.lower(): v for k, v in self.headers.items()},
                        body))
                self.send_response(receiver.status)
                if receiver.location is not None:
                    self.send_header("Location", receiver.location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_args: object) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        if self.tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*self.tls)
            self._server.socket = ctx.wrap_socket(self._server.socket, server_side=True)
        threading.Thread(target=self._server.serve_forever, daemon=True,
                         name=f"receiver-{self.port}").start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def received(self) -> list[Received]:
        with self._lock:
            return list(self.requests)

    def wait_for(self, n: int, timeout: float = 60) -> list[Received]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.received()
            if len(got) >= n:
                return got
            time.sleep(0.02)
        raise TimeoutError(f"receiver on {self.port}: {len(self.received())} of {n} requests")
