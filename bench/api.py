"""``make bench-api``: job-read throughput and latency against a bare FastAPI peer, and
the service's own overhead on a tiny job.

1. Starts its own service (temp dir, free ports): redis-server, one Celery worker and the
   API under uvicorn, as in production: not dev mode, API keys configured by their
   sha256 (``MAEC_API_KEYS``), so every request below is authenticated with a real key.
   The per-key rate limits are raised out of the way (one key sends all the load);
   the limiter still runs on every request.
2. Job overhead: tiny task-arithmetic jobs, submit -> succeeded as a client polling
   every 5 ms sees it, minus the merge time the worker reports (``core_seconds``);
   the median of several jobs.
3. Throughput: ``GET /v1/jobs/{id}`` from 64 concurrent keep-alive connections (PROCS
   processes of asyncio clients) for a fixed duration, against ours and against a bare
   FastAPI endpoint returning the same JSON body, served by uvicorn with the same
   settings and the same garbage-collector tuning (app/api/gc_tuning.py), in this run.
   Short rounds alternate between the two, the order swapped every round.

4. Job wall time against the merge's own time, on a real size: a task-arithmetic job over
   the engine benchmark's three 0.85B bf16 checkpoints (bench/cache, built once) on a
   service storing results in S3 (SeaweedFS, started here), submit -> succeeded as a
   polling client sees it, over the merge time the worker reports. Shards upload while
   the merge goes on, so most of the upload hides behind it. ``BENCH_WALL_SMALL=1`` uses
   the small shape instead (a quick check of the harness).

Ends with ``RESULT api rps_ratio_vs_bare=<ours/bare> p99_ms=<ours> job_overhead_s=<s>
job_wall_vs_merge=<wall/merge>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
from fastapi import FastAPI
from fastapi.responses import Response

from app.api.gc_tuning import tune_gc
from app.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CLIENTS = 64
PROCS = int(os.environ.get("BENCH_PROCS", 2))
DURATION = float(os.environ.get("BENCH_SECONDS", 2))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", 6))
JOBS = int(os.environ.get("BENCH_JOBS", 7))
BODY_FILE = os.environ.get("BENCH_BARE_BODY", "")

# Our API's young-generation threshold unless the environment sets one; both sides get it.
GC_THRESHOLD = int(os.environ.get("MAEC_API_GC_THRESHOLD")
                   or Settings.model_fields["api_gc_threshold"].default)


@contextlib.asynccontextmanager
async def _bare_lifespan(app: FastAPI) -> AsyncIterator[None]:
    # Where ours tunes the collector: once the app is built, before the first request.
    tune_gc(GC_THRESHOLD)
    yield


# The peer: same route shape, same body, same GC tuning; no auth, no Redis.
bare_app = FastAPI(lifespan=_bare_lifespan)
_BODY = Path(BODY_FILE).read_bytes() if BODY_FILE and Path(BODY_FILE).is_file() else b"{}"


@bare_app.get("/v1/jobs/{job_id}")
async def bare_job(job_id: str) -> Response:
    return Response(_BODY, media_type="application/json")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: process exited")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not come up")


@contextlib.contextmanager
def service() -> Iterator[tuple[str, Path, str, int]]:
    """A keyed service of our own: (url, models folder, API key, API pid)."""
    from tests.stack import RedisServer, Stack

    var = Path(tempfile.mkdtemp(prefix="maec-bench-"))
    models = var / "models"
    models.mkdir()
    key = secrets.token_urlsafe(24)
    # Ten keys configured, as a small team would have; the load uses one of them.
    keys = {"bench": key, **{f"user{i}": secrets.token_urlsafe(24) for i in range(9)}}
    env = {
        "MAEC_DEV_MODE": "false",
        "MAEC_API_KEYS": json.dumps({k: hashlib.sha256(v.encode()).hexdigest()
                                     for k, v in keys.items()}),
        "MAEC_RATE_LIMIT_PER_MINUTE": "100000000",
        "MAEC_RATE_LIMIT_BURST": "10000000",
        "MAEC_SUBMISSIONS_PER_MINUTE": "100000",
        "MAEC_API_GC_THRESHOLD": str(GC_THRESHOLD),
        "MAEC_STORAGE_BACKEND": "local",
        "MAEC_STORAGE_DIR": str(var / "storage"),
        "MAEC_WORK_DIR": str(var / "work"),
        "MAEC_CACHE_DIR": str(var / "checksums"),
        "MAEC_LOCAL_ROOTS": json.dumps([str(models)]),
        "PYTHONUNBUFFERED": "1",
    }
    stack = Stack(root=var, redis=RedisServer(var / "redis"), redis_db=0, own_redis=True,
                  env=env)
    print(f"bench: starting a keyed service (not dev mode) under {var}", flush=True)
    try:
        stack.redis.start()
        stack.start_worker(wait=False)
        api = stack.start_api()
        _wait_ready(stack.base_url + "/readyz", key)
        yield stack.base_url, models, key, api.pid
    finally:
        stack.stop()
        shutil.rmtree(var, ignore_errors=True)


def _wait_ready(url: str, key: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, headers=_auth(key), timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise SystemExit(f"bench: {url} not ready within {timeout:.0f}s")


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def job_overhead(url: str, models: Path, key: str) -> tuple[float, str]:
    from tests.factories import make_llama

    d = models / "bench"
    if not (d / "lang" / "model.safetensors").is_file():
        make_llama(d / "base", 0)
        make_llama(d / "donor", 1, like=d / "base")
        make_llama(d / "lang", 2, like=d / "base")
    body = {"method": "task_arithmetic", "base": str(d / "base"),
            "ability_donor": [str(d / "donor")], "language_base": str(d / "lang")}
    overheads: list[float] = []
    job_id = ""
    with httpx.Client(base_url=url, headers=_auth(key), timeout=30) as c:
        for _ in range(JOBS):
            t0 = time.perf_counter()
            r = c.post("/v1/jobs", json=body)
            r.raise_for_status()
            job_id = r.json()["id"]
            while True:
                job = c.get(f"/v1/jobs/{job_id}").json()
                if job["status"] in ("succeeded", "failed", "cancelled"):
                    break
                time.sleep(0.005)
            total = time.perf_counter() - t0
            if job["status"] != "succeeded":
                raise SystemExit(f"bench job {job_id} {job['status']}: {job['error']}")
            overheads.append(total - float(job["result"]["core_seconds"]))
            time.sleep(0.3)  # let the worker replace its child, as between real jobs
    print(f"bench: job overhead per job (s): {[round(x, 3) for x in overheads]}")
    return statistics.median(overheads), job_id


async def _client(host: str, port: int, request: bytes, stop: float,
                  lat: list[float]) -> int:
    """One keep-alive HTTP/1.1 connection issuing ``request`` until ``stop``.

    A minimal client (no pool, no parsing beyond Content-Length): httpx's async pool
    costs more CPU per request than the endpoints measured here, so with it the
    benchmark measures the client.
    """
    reader, writer = await asyncio.open_connection(host, port)
    errors = 0
    try:
        while time.perf_counter() < stop:
            t = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            lat.append(time.perf_counter() - t)
            errors += status != 200
    finally:
        writer.close()
    return errors


def _load_proc(url: str, path: str, clients: int, duration: float, hdrs: dict[str, str],
               out: Any) -> None:
    host, port = url.removeprefix("http://").split(":")
    extra = "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
    request = (f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n").encode()

    async def run() -> tuple[int, list[float], int]:
        lat: list[float] = []
        stop = time.perf_counter() + duration
        errors = await asyncio.gather(*(_client(host, int(port), request, stop, lat)
                                        for _ in range(clients)))
        return len(lat), lat, sum(errors)

    n, lat, errors = asyncio.run(run())
    out.put((n, lat, errors))


def load(url: str, path: str, hdrs: dict[str, str]) -> tuple[float, float]:
    """(requests per second, p99 ms) of 64 clients for DURATION seconds."""
    q: Any = mp.get_context("fork").Queue()
    per = CLIENTS // PROCS
    procs = [mp.get_context("fork").Process(target=_load_proc,
                                            args=(url, path, per, DURATION, hdrs, q))
             for _ in range(PROCS)]
    for p in procs:
        p.start()
    results = [q.get() for _ in procs]
    for p in procs:
        p.join()
    total = sum(r[0] for r in results)
    errors = sum(r[2] for r in results)
    if errors:
        raise SystemExit(f"bench: {errors} non-200 answers from {url}{path}")
    lat = sorted(x for r in results for x in r[1])
    if not lat:
        raise SystemExit(f"bench: no answers from {url}{path}")
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000
    return total / DURATION, p99


@contextlib.contextmanager
def bare_peer(body: bytes) -> Iterator[tuple[str, int]]:
    """The bare FastAPI endpoint serving ``body``: (url, pid)."""
    body_file = Path(tempfile.mkstemp(prefix="maec-bench-body-")[1])
    body_file.write_bytes(body)
    port = _free_port()
    # Served as ours is: one uvicorn process, default loop/http, no access log.
    bare = subprocess.Popen(
        [str(BIN / "uvicorn"), "bench.api:bare_app", "--host", "127.0.0.1", "--port",
         str(port), "--no-access-log"], cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, env={**os.environ, "BENCH_BARE_BODY": str(body_file),
                                        "MAEC_API_GC_THRESHOLD": str(GC_THRESHOLD)})
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_http(url + "/v1/jobs/x", bare)
        yield url, bare.pid
    finally:
        bare.terminate()
        bare.wait(10)
        body_file.unlink(missing_ok=True)


def measure_rounds(sides: dict[str, tuple[str, dict[str, str], int]], path: str
                   ) -> tuple[dict[str, list[tuple[float, float]]], dict[str, float]]:
    """ROUNDS short rounds per side, alternating, the order rotated every round, so
    drifting load from anything else on the machine hits every side alike; the
    (req/s, p99 ms) of each round and each server's CPU seconds per request."""
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    cpu = dict.fromkeys(sides, 0.0)
    served = dict.fromkeys(sides, 0.0)
    procs = {name: psutil.Process(pid) for name, (_, _, pid) in sides.items()}
    order = list(sides)
    for i in range(ROUNDS):
        shift = i % len(order)
        for name in order[shift:] + order[:shift]:
            target, hdrs, _ = sides[name]
            before = _cpu(procs[name])
            runs[name].append(load(target, path, hdrs))
            cpu[name] += _cpu(procs[name]) - before
            served[name] += runs[name][-1][0] * DURATION
    per_request = {name: cpu[name] / served[name] if served[name] else 0.0 for name in sides}
    return runs, per_request


def _breakdown(job: dict[str, Any], wall: float, merge: float) -> str:
    """Where a job's wall beyond its merge went, from the record's timestamps: waiting
    to be claimed, the worker's own steps around the merge (fetch, publish, status
    write), and the rest (submission, the client's polling)."""
    from datetime import datetime

    def at(field: str) -> float:
        return datetime.fromisoformat(job[field].replace("Z", "+00:00")).timestamp()

    queued = at("started_at") - at("created_at")
    worker = at("finished_at") - at("started_at")
    return (f"queued {queued:.2f} s, worker {worker:.2f} s (merge {merge:.2f} + around it "
            f"{worker - merge:.2f}), submission and polling {wall - queued - worker:.2f} s")


def job_wall_vs_merge() -> float:
    """Submit -> succeeded wall time of one 0.85B task-arithmetic job with S3 storage,
    over the merge time its worker reports (``core_seconds``); the second of two jobs,
    so the input cache and digests are warm as on a busy service."""
    from bench.engine import FULL, SMALL, ensure_models
    from tests.stack import API_KEYS, S3Server, stack_context

    small = os.environ.get("BENCH_WALL_SMALL") == "1"
    folders = ensure_models(*((SMALL, "llama-small") if small else (FULL, "llama-0.85b")))
    base, *donors = folders
    body = {"method": "task_arithmetic", "base": str(base),
            "ability_donor": [str(donors[0])], "language_base": str(donors[1])}
    var = Path(tempfile.mkdtemp(prefix="maec-bench-wall-"))
    s3 = S3Server(var / "s3").start()
    ratios: list[float] = []
    try:
        # The client polls every 50 ms: the per-key read limit is raised out of the way.
        limits = {"MAEC_RATE_LIMIT_PER_MINUTE": "1000000", "MAEC_RATE_LIMIT_BURST": "100000"}
        with stack_context(var / "stack", None, storage="s3", s3=s3,
                           local_roots=[base.parent], env=limits) as stack, \
                httpx.Client(base_url=stack.base_url, timeout=60,
                             headers=_auth(API_KEYS["alice"])) as c:
            for _ in range(2):
                t0 = time.perf_counter()
                r = c.post("/v1/jobs", json=body)
                r.raise_for_status()
                jid = r.json()["id"]
                while True:
                    got = c.get(f"/v1/jobs/{jid}")
                    got.raise_for_status()
                    job = got.json()
                    if job["status"] in ("succeeded", "failed", "cancelled"):
                        break
                    time.sleep(0.05)
                wall = time.perf_counter() - t0
                if job["status"] != "succeeded":
                    raise SystemExit(f"bench job {jid} {job['status']}: {job['error']}")
                merge = float(job["result"]["core_seconds"])
                ratios.append(wall / merge)
                print(f"bench: {base.parent.name} job on S3: wall {wall:.2f} s, "
                      f"merge {merge:.2f} s; {_breakdown(job, wall, merge)}", flush=True)
    finally:
        s3.stop()
        shutil.rmtree(var, ignore_errors=True)
    return ratios[-1]


def main() -> int:
    with service() as (url, models, key, api_pid):
        overhead, job_id = job_overhead(url, models, key)
        path = f"/v1/jobs/{job_id}"
        body = httpx.get(url + path, headers=_auth(key)).content
        with bare_peer(body) as (bare_url, bare_pid):
            assert httpx.get(bare_url + path).content == body
            runs, cpu = measure_rounds({"ours": (url, _auth(key), api_pid),
                                        "bare": (bare_url, {}, bare_pid)}, path)
    ours_runs, bare_runs = runs["ours"], runs["bare"]
    ours_rps = statistics.fmean(r for r, _ in ours_runs)
    bare_rps = statistics.fmean(r for r, _ in bare_runs)
    # Paired rounds, median ratio: load from anything else on the machine drifts, and
    # each pair saw about the same.
    ratio = statistics.median(o / b for (o, _), (b, _) in zip(ours_runs, bare_runs,
                                                              strict=True))
    ours_p99 = statistics.median(p for _, p in ours_runs)
    bare_p99 = statistics.median(p for _, p in bare_runs)
    print(f"bench: rounds ours {[round(r) for r, _ in ours_runs]} "
          f"bare {[round(r) for r, _ in bare_runs]} req/s")
    print(f"bench: server CPU per request: ours {1e6 * cpu['ours']:.0f} us, bare "
          f"{1e6 * cpu['bare']:.0f} us (insensitive to other load)")
    print(f"bench: GET {path} ({len(body)} bytes), {CLIENTS} connections, "
          f"{ROUNDS} x {DURATION:.0f}s each side, {PROCS} client processes; ours "
          f"authenticated (API key, not dev mode); GC threshold {GC_THRESHOLD} on both")
    print(f"bench: ours {ours_rps:8.0f} req/s  p99 {ours_p99:6.1f} ms")
    print(f"bench: bare {bare_rps:8.0f} req/s  p99 {bare_p99:6.1f} ms")
    print(f"bench: job overhead (median of {JOBS}) {overhead:.3f} s")
    wall_ratio = job_wall_vs_merge()
    print(f"RESULT api rps_ratio_vs_bare={ratio:.3f} p99_ms={ours_p99:.1f} "
          f"job_overhead_s={overhead:.3f} job_wall_vs_merge={wall_ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
