"""Downloads over real sockets (127.0.0.1), where an interruption is a dropped TCP stream.

MockTransport (test_download.py) raises the error httpx would; here the server really
closes the connection mid-body, so the client sees whatever httpx makes of that.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from maec_client import Client, ClientConfig, NetworkError
from tests.client.test_download import payload

BIG = payload(3_000_000, 7)
SMALL = payload(5_000, 8)


class _State:
    def __init__(self) -> None:
        self.files = {"big.bin": BIG, "small.bin": SMALL}
        self.cuts: list[int] = []  # next file responses: send this many bytes, then drop
        self.ranges: list[str] = []
        self.lock = threading.Lock()

    def job(self, port: int) -> dict:
        files = [{"path": p, "size": len(d), "sha256": hashlib.sha256(d).hexdigest(),
                  "url": f"/v1/jobs/j_1/files/{p}"} for p, d in self.files.items()]
        return {"id": "j_1", "status": "succeeded", "progress": {"fraction": 1.0},
                "result": {"manifest": {"files": files}, "report": {}, "files": files}}


@pytest.fixture
def server():
    state = _State()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep pytest output clean
            pass

        def do_GET(self):
            if self.headers.get("Authorization") != "Bearer k":
                return self._json(401, {"code": "unauthorized", "message": "no", "details": {}})
            if self.path == "/v1/jobs/j_1":
                return self._json(200, state.job(self.server.server_port))
            m = re.fullmatch(r"/v1/jobs/j_1/files/(.+)", self.path)
            data = state.files.get(m.group(1)) if m else None
            if data is None:
                return self._json(404, {"code": "file_not_found", "message": "no",
                                        "details": {}})
            rng = self.headers.get("Range", "")
            with state.lock:
                state.ranges.append(f"{m.group(1)} {rng}")
                cut = state.cuts.pop(0) if state.cuts else None
            a, b = (int(x) for x in re.fullmatch(r"bytes=(\d+)-(\d+)", rng).groups())
            body = data[a:b + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {a}-{b}/{len(data)}")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.end_headers()
            if cut is None:
                self.wfile.write(body)
                return
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.close_connection = True  # drop the stream mid-body

        def _json(self, status, obj):
            raw = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{httpd.server_port}"
    yield state
    httpd.shutdown()
    httpd.server_close()


def make_client(state) -> Client:
    return Client(config=ClientConfig(url=state.url, api_key="k", timeout=10),
                  sleep=lambda s: None)


def test_parallel_ranges_over_real_sockets(server, tmp_path):
    with make_client(server) as c:
        c.download("j_1", tmp_path / "out", part_size=500_000, workers=6)
    assert (tmp_path / "out" / "big.bin").read_bytes() == BIG
    assert (tmp_path / "out" / "small.bin").read_bytes() == SMALL
    assert sum(r.startswith("big.bin") for r in server.ranges) == 6


def test_dropped_connection_resumes_in_call_and_across_calls(server, tmp_path):
    server.cuts = [1_234_567]
    with make_client(server) as c:
        c.download("j_1", tmp_path / "a", part_size=10**9, workers=1)
    assert (tmp_path / "a" / "big.bin").read_bytes() == BIG
    assert server.ranges[:2] == ["big.bin bytes=0-2999999", "big.bin bytes=1234567-2999999"]

    server.ranges.clear()
    server.cuts = [1_000_000, 0]
    with make_client(server) as c, pytest.raises(NetworkError):
        c.download("j_1", tmp_path / "b", part_size=10**9, workers=1, retries=0)
    assert (tmp_path / "b.partial" / "big.bin.part").stat().st_size == 1_000_000
    with make_client(server) as c:
        c.download("j_1", tmp_path / "b", part_size=10**9, workers=2)
    assert (tmp_path / "b" / "big.bin").read_bytes() == BIG
    assert "big.bin bytes=1000000-2999999" in server.ranges
