"""An in-memory stand-in for the service, speaking docs/api.md's shapes over MockTransport.

Just enough of the contract for the client's logic (auth, errors, idempotency, paging,
cancel, Range downloads); the real service is exercised in test_client_stack.py. Fault
hooks let a test fail requests, cut a stream after N bytes, or corrupt a served byte.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import httpx

TERMINAL = {"succeeded", "failed", "cancelled"}
STORE_HOST = "127.0.0.3"


def err(status: int, code: str, message: str = "", headers: dict[str, str] | None = None,
        **details: Any) -> httpx.Response:
    return httpx.Response(status, json={"code": code, "message": message or code,
                                        "details": details}, headers=headers)


class CutStream(httpx.SyncByteStream):
    """Yields ``limit`` bytes of ``data`` then fails like a dropped connection."""

    def __init__(self, data: bytes, limit: int, chunk: int = 1000) -> None:
        self.data, self.limit, self.chunk = data, limit, chunk

    def __iter__(self):
        sent = 0
        while sent < self.limit:
            n = min(self.chunk, self.limit - sent)
            yield self.data[sent:sent + n]
            sent += n
        raise httpx.ReadError("connection reset by fake service")


class ChunkedStream(httpx.SyncByteStream):
    def __init__(self, data: bytes, chunk: int = 4096) -> None:
        self.data, self.chunk = data, chunk

    def __iter__(self):
        for i in range(0, len(self.data), self.chunk):
            yield self.data[i:i + self.chunk]


@dataclass
class FakeService:
    keys: set[str] = field(default_factory=lambda: {"k1"})
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    files: dict[tuple[str, str], bytes] = field(default_factory=dict)
    requests: list[httpx.Request] = field(default_factory=list)
    # Fault hooks (each consumed once): status codes to answer before serving normally,
    # byte counts at which to cut the next file streams, (job, path, offset) to corrupt.
    fail_next: list[int] = field(default_factory=list)
    cut_next: list[int] = field(default_factory=list)
    corrupt: set[tuple[str, str, int]] = field(default_factory=set)
    ignore_range: bool = False
    # Statuses that successive GETs of a job walk through (for wait()).
    script: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    idem: dict[str, str] = field(default_factory=dict)
    counter: int = 0
    bytes_served: int = 0

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    # -- helpers for tests ----------------------------------------------------------------

    def add_job(self, status: str = "queued", **extra: Any) -> dict[str, Any]:
        self.counter += 1
        job = {"id": f"j_{self.counter:04d}", "status": status, "stage": None,
               "progress": {"fraction": 0.0, "done": 0, "total": 0}, "method": "linear",
               "name": None, "recipe": {}, "created_at": f"2026-01-01T00:00:{self.counter:02d}Z",
               "started_at": None, "finished_at": None, "attempts": 0,
               "cancel_requested": False, "artifact_reused": None, "error": None,
               "result": None, "pinned": False, **extra}
        self.jobs[job["id"]] = job
        return job

    def finish(self, job_id: str, files: dict[str, bytes], *, absolute: str | None = None,
               manifest_override: dict[str, Any] | None = None) -> dict[str, Any]:
        entries = []
        for path, data in files.items():
            self.files[(job_id, path)] = data
            url = f"/v1/jobs/{job_id}/files/{path}"
            entries.append({"path": path, "size": len(data),
                            "sha256": hashlib.sha256(data).hexdigest(),
                            "url": (absolute + url) if absolute else url})
        manifest = {"format_version": 1,
                    "files": [e for e in entries if e["path"] != "manifest.json"]}
        if manifest_override is not None:
            manifest = manifest_override
        job = self.jobs[job_id]
        job.update(status="succeeded", stage=None, finished_at="2026-01-01T01:00:00Z",
                   progress={"fraction": 1.0, "done": 1, "total": 1},
                   result={"manifest": manifest, "report": {}, "files": entries,
                           "core_seconds": 0.1})
        return job

    def file_requests(self) -> list[httpx.Request]:
        return [r for r in self.requests if "/files/" in r.url.path]

    # -- the "service" --------------------------------------------------------------------

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.fail_next:
            status = self.fail_next.pop(0)
            if status == 0:
                raise httpx.ConnectError("fake connect failure")
            return err(status, {429: "rate_limited", 503: "unavailable"}.get(status, "boom"),
                       headers={"Retry-After": "0"} if status == 429 else None)
        path = request.url.path
        if request.url.host == STORE_HOST:
            # A "presigned" store URL: no API key, its own (MD5) ETag, Range honoured.
            m = re.fullmatch(r"/bucket/([^/]+)/(.+)", path)
            assert m and request.url.params.get("sig") == "ok", request.url
            if "authorization" in request.headers:
                return err(400, "two_auth_mechanisms")
            return self._file(request, m.group(1), unquote(m.group(2)), store=True)
        if path == "/healthz":
            return httpx.Response(200, json={"status": "ok"})
        auth = request.headers.get("authorization", "")
        if not auth.startswith("Bearer ") or auth[7:] not in self.keys:
            return err(401, "unauthorized", "missing or unknown API key")
        if path == "/v1/jobs" and request.method == "POST":
            return self._submit(request)
        if path == "/v1/jobs" and request.method == "GET":
            return self._list(request)
        m = re.fullmatch(r"/v1/jobs/([^/]+)(/cancel|/pin|/unpin|/files/(.+))?", path)
        if not m:
            return err(404, "not_found")
        job = self.jobs.get(unquote(m.group(1)))
        if job is None:
            return err(404, "job_not_found", job_id=m.group(1))
        if m.group(2) == "/cancel" and request.method == "POST":
            if job["status"] == "cancelled":  # idempotent, as the service answers
                return httpx.Response(202, json=job)
            if job["status"] in TERMINAL:
                return err(409, "job_finished", job_status=job["status"])
            job["cancel_requested"] = True
            if job["status"] == "queued":
                job["status"] = "cancelled"
            return httpx.Response(202, json=job)
        if m.group(2) in ("/pin", "/unpin") and request.method == "POST":
            job["pinned"] = m.group(2) == "/pin"
            return httpx.Response(200, json=job)
        if m.group(2) is None and request.method == "DELETE":
            if job["status"] not in TERMINAL:
                return err(409, "job_active", job_status=job["status"])
            del self.jobs[job["id"]]
            return httpx.Response(204)
        if m.group(3):
            return self._file(request, job["id"], unquote(m.group(3)))
        steps = self.script.get(job["id"])
        if steps:
            job.update(steps.pop(0))
        return httpx.Response(200, json=job)

    def _submit(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if ("recipe" in body) == ("method" in body):
            return err(422, "invalid_request", "exactly one of recipe or method")
        recipe = body.get("recipe") or {"merge_method": body["method"]}
        if recipe.get("merge_method") == "nope":
            return err(422, "invalid_recipe", "unknown merge_method 'nope'", key="merge_method")
        key = body.get("idempotency_key")
        if key and key in self.idem:
            return httpx.Response(200, json=self.jobs[self.idem[key]])
        method = "moe" if body.get("kind") == "moe" else recipe["merge_method"]
        job = self.add_job(method=method, recipe=recipe, name=body.get("name"))
        if key:
            self.idem[key] = job["id"]
        return httpx.Response(202, json=job, headers={"Location": f"/v1/jobs/{job['id']}"})

    def _list(self, request: httpx.Request) -> httpx.Response:
        q = request.url.params
        limit = int(q.get("limit", "20"))
        if not 1 <= limit <= 100:
            return err(422, "invalid_request", "limit must be 1..100")
        jobs = sorted(self.jobs.values(), key=lambda j: j["id"], reverse=True)
        if q.get("status"):
            jobs = [j for j in jobs if j["status"] == q["status"]]
        if q.get("cursor"):
            jobs = [j for j in jobs if j["id"] < q["cursor"]]
        page = jobs[:limit]
        nxt = page[-1]["id"] if len(jobs) > limit else None
        return httpx.Response(200, json={"jobs": page, "next_cursor": nxt})

    def _file(self, request: httpx.Request, job_id: str, path: str,
              store: bool = False) -> httpx.Response:
        data = self.files.get((job_id, path))
        if data is None:
            return err(404, "file_not_found", path=path)
        if request.url.params.get("redirect") == "true" and not store:
            loc = f"http://{STORE_HOST}:9000/bucket/{job_id}/{path}?sig=ok"
            return httpx.Response(307, headers={"Location": loc})
        sha = hashlib.sha256(data).hexdigest()
        for cj, cp, off in self.corrupt:
            if (cj, cp) == (job_id, path):
                data = data[:off] + bytes([data[off] ^ 0xFF]) + data[off + 1:]
        etag = hashlib.md5(data).hexdigest() if store else sha
        headers = {"Accept-Ranges": "bytes", "ETag": f'"{etag}"'}
        start, end, status = 0, len(data) - 1, 200
        rng = request.headers.get("range")
        if rng and not self.ignore_range:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng)
            assert m, rng
            start = int(m.group(1))
            end = min(int(m.group(2)) if m.group(2) else len(data) - 1, len(data) - 1)
            if start >= len(data):
                return err(416, "range_not_satisfiable",
                           headers={"Content-Range": f"bytes */{len(data)}"})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        body = data[start:end + 1]
        headers["Content-Length"] = str(len(body))
        if self.cut_next:
            limit = self.cut_next.pop(0)
            self.bytes_served += min(limit, len(body))
            return httpx.Response(status, headers=headers, stream=CutStream(body, limit))
        self.bytes_served += len(body)
        return httpx.Response(status, headers=headers, stream=ChunkedStream(body))
