"""``make bench-api``: job-read throughput and latency against a bare FastAPI peer, and
the service's own overhead on a tiny job.

1. Uses the service ``make run`` started (var/run.json), or starts one (temp dir, free
   port) for the run.
2. Job overhead: tiny task-arithmetic jobs, submit -> succeeded as a client polling
   every 5 ms sees it, minus the merge time the worker reports (``core_seconds``);
   the median of several jobs.
3. Throughput: ``GET /v1/jobs/{id}`` from 64 concurrent keep-alive connections (PROCS
   processes of asyncio clients) for a fixed duration, then the same load on a bare FastAPI endpoint
   returning the same JSON body, served by uvicorn with the same settings, in this run.

Ends with ``RESULT api rps_ratio_vs_bare=<ours/bare> p99_ms=<ours> job_overhead_s=<s>``.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from fastapi import FastAPI
from fastapi.responses import Response

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CLIENTS = 64
PROCS = int(os.environ.get("BENCH_PROCS", 2))
DURATION = float(os.environ.get("BENCH_SECONDS", 2))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", 6))
JOBS = int(os.environ.get("BENCH_JOBS", 7))
BODY_FILE = os.environ.get("BENCH_BARE_BODY", "")

# The peer: same route shape, same body, no auth, no Redis.
bare_app = FastAPI()
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


def service() -> tuple[str, Path, subprocess.Popen[bytes] | None]:
    state = ROOT / "var" / "run.json"
    if state.is_file():
        doc = json.loads(state.read_text())
        try:
            if httpx.get(doc["url"] + "/healthz", timeout=2).status_code == 200:
                print(f"bench: using the running service at {doc['url']}")
                return doc["url"], Path(doc["models"]), None
        except httpx.HTTPError:
            pass
    var = Path(tempfile.mkdtemp(prefix="maec-bench-"))
    port = _free_port()
    print(f"bench: no running service; starting one on 127.0.0.1:{port} ({var})")
    proc = subprocess.Popen([sys.executable, "-m", "app.run_local", "--var", str(var),
                             "--port", str(port)], cwd=ROOT, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while not (var / "run.json").is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("bench: the service did not start")
        time.sleep(0.3)
    return url, var / "models", proc


def _listener(url: str) -> psutil.Process | None:
    """The process serving ``url`` (for its CPU time), when this user can see it."""
    port = int(url.rsplit(":", 1)[1])
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
                return psutil.Process(conn.pid)
    except psutil.Error:
        pass
    return None


def _cpu(proc: psutil.Process | None) -> float:
    if proc is None:
        return 0.0
    t = proc.cpu_times()
    return float(t.user + t.system)


def headers() -> dict[str, str]:
    key = os.environ.get("MAEC_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def job_overhead(url: str, models: Path) -> tuple[float, str]:
    sys.path.insert(0, str(ROOT))
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
    with httpx.Client(base_url=url, headers=headers(), timeout=30) as c:
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


def main() -> int:
    url, models, started = service()
    bare: subprocess.Popen[bytes] | None = None
    try:
        overhead, job_id = job_overhead(url, models)
        path = f"/v1/jobs/{job_id}"
        body = httpx.get(url + path, headers=headers()).content
        body_file = Path(tempfile.mkstemp(prefix="maec-bench-body-")[1])
        body_file.write_bytes(body)
        port = _free_port()
        # The API as `make run` serves it: one uvicorn process, default loop/http.
        bare = subprocess.Popen(
            [str(BIN / "uvicorn"), "bench.api:bare_app", "--host", "127.0.0.1", "--port",
             str(port), "--no-access-log"], cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, env={**os.environ, "BENCH_BARE_BODY": str(body_file)})
        bare_url = f"http://127.0.0.1:{port}"
        _wait_http(bare_url + path, bare)
        assert httpx.get(bare_url + path).content == body
        # Alternate short rounds, so drifting load from anything else on the machine
        # hits both sides alike.
        ours_runs: list[tuple[float, float]] = []
        bare_runs: list[tuple[float, float]] = []
        ours_proc, bare_proc = _listener(url), psutil.Process(bare.pid)
        cpu = {"ours": 0.0, "bare": 0.0}
        served = {"ours": 0.0, "bare": 0.0}
        for _ in range(ROUNDS):
            for side, target, hdrs, proc, runs in (
                ("ours", url, headers(), ours_proc, ours_runs),
                ("bare", bare_url, {}, bare_proc, bare_runs),
            ):
                before = _cpu(proc)
                runs.append(load(target, path, hdrs))
                cpu[side] += _cpu(proc) - before
                served[side] += runs[-1][0] * DURATION
        ours_rps = statistics.fmean(r for r, _ in ours_runs)
        bare_rps = statistics.fmean(r for r, _ in bare_runs)
        # Paired rounds, median ratio: load from anything else on the machine drifts,
        # and each pair saw about the same.
        ratio = statistics.median(o / b for (o, _), (b, _) in zip(ours_runs, bare_runs,
                                                                  strict=True))
        ours_p99 = statistics.median(p for _, p in ours_runs)
        bare_p99 = statistics.median(p for _, p in bare_runs)
        print(f"bench: rounds ours {[round(r) for r, _ in ours_runs]} "
              f"bare {[round(r) for r, _ in bare_runs]} req/s")
        if served["ours"] and served["bare"]:
            print(f"bench: server CPU per request: ours "
                  f"{1e6 * cpu['ours'] / served['ours']:.0f} us, bare "
                  f"{1e6 * cpu['bare'] / served['bare']:.0f} us (insensitive to other load)")
        print(f"bench: GET {path} ({len(body)} bytes), {CLIENTS} connections, "
              f"{ROUNDS} x {DURATION:.0f}s each side, {PROCS} client processes")
        print(f"bench: ours {ours_rps:8.0f} req/s  p99 {ours_p99:6.1f} ms")
        print(f"bench: bare {bare_rps:8.0f} req/s  p99 {bare_p99:6.1f} ms")
        print(f"bench: job overhead (median of {JOBS}) {overhead:.3f} s")
        print(f"RESULT api rps_ratio_vs_bare={ratio:.3f} p99_ms={ours_p99:.1f} "
              f"job_overhead_s={overhead:.3f}")
        return 0
    finally:
        if bare is not None:
            bare.terminate()
            bare.wait(10)
        if started is not None:
            started.send_signal(signal.SIGINT)
            started.wait(60)


if __name__ == "__main__":
    sys.exit(main())
