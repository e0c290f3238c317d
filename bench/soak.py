"""Soak: jobs submitted steadily for ``--minutes`` while a fault is injected every
``--kill-every`` seconds; then every accepted job is audited. Not part of CI
(``make soak``; ``SOAK_ARGS="--minutes 2"`` for a short one).

Faults rotate through: SIGKILL of the pool child running a job, SIGKILL of a whole worker
(then a replacement is started), SIGKILL of the API (restarted), SIGKILL of redis-server
(restarted from its AOF). Clients behave as the shipped client does: they retry
connection errors and 503s with the same idempotency key, so a retried submission never
creates a second job.

Prints the figures and writes them to ``var/reliability/soak.json``: jobs accepted,
succeeded, failed by code, lost (accepted but never terminal), duplicate runs (more than
one manifest for a job), attempts, submit and end-to-end latency percentiles.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import threading
import time
import uuid
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any, cast

import httpx
import psutil
import redis
import torch

from tests.factories import make_llama
from tests.stack import (
    API_KEYS,
    ROOT,
    S3_BUCKET,
    TERMINAL,
    Proc,
    S3Server,
    Stack,
    stack_context,
)

ENV = {
    "MAEC_LEASE_SECONDS": "3",
    "MAEC_MAX_ATTEMPTS": "5",
    "MAEC_RATE_LIMIT_PER_MINUTE": "1000000",
    "MAEC_RATE_LIMIT_BURST": "100000",
    "MAEC_SUBMISSIONS_PER_MINUTE": "100000",
    "MAEC_MAX_ACTIVE_JOBS_PER_KEY": "100000",
    "MAEC_PROGRESS_INTERVAL": "0.2",
}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def ts(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


class Soak:
    def __init__(self, stack: Stack, s3: S3Server, bodies: list[dict[str, Any]],
                 clients: int, interval: float) -> None:
        self.stack = stack
        self.s3 = s3
        self.bodies = bodies
        self.clients = clients
        self.interval = interval
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.accepted: dict[str, str] = {}  # job id -> key
        self.submit_ms: list[float] = []
        self.retries = 0
        self.gave_up = 0
        self.faults: list[tuple[float, str]] = []

    # -- clients -------------------------------------------------------------------

    def _submit(self, c: httpx.Client, body: dict[str, Any]) -> str | None:
        body = {**body, "idempotency_key": uuid.uuid4().hex}
        t = time.perf_counter()
        for _ in range(120):  # up to ~60 s of outage per submission
            try:
                resp = c.post("/v1/jobs", json=body)
            except httpx.TransportError:
                resp = None
            if resp is not None and resp.status_code in (200, 202):
                with self.lock:
                    self.submit_ms.append((time.perf_counter() - t) * 1000)
                return str(resp.json()["id"])
            if resp is not None and resp.status_code not in (502, 503, 504):
                raise RuntimeError(f"submission refused: {resp.status_code} {resp.text}")
            with self.lock:
                self.retries += 1
            time.sleep(0.5)
        with self.lock:
            self.gave_up += 1
        return None

    def client(self, n: int) -> None:
        key = "alice" if n % 2 == 0 else "bob"
        with httpx.Client(base_url=self.stack.base_url, timeout=30,
                          headers={"Authorization": f"Bearer {API_KEYS[key]}"}) as c:
            i = 0
            while not self.stop.is_set():
                job_id = self._submit(c, self.bodies[(n + i) % len(self.bodies)])
                i += 1
                if job_id:
                    with self.lock:
                        self.accepted[job_id] = key
                self.stop.wait(self.interval)

    # -- faults --------------------------------------------------------------------

    def _busy_child(self) -> tuple[int, Proc] | None:
        """A pool child that is running a job right now (from the running jobs' records),
        with its worker; None when every worker is idle."""
        r = redis.Redis.from_url(self.stack.redis_url, socket_timeout=2)
        pids: set[int] = set()
        try:
            running = cast(list[bytes], r.zrange("maec:status:running", 0, -1))
            for job_id in running:
                raw = cast(bytes | None, r.hget(f"maec:job:{job_id.decode()}", "worker"))
                owner = json.loads(raw) if raw else None
                if owner:
                    pids.add(int(str(owner).rsplit(":", 1)[1]))
        finally:
            r.close()
        for proc in self.stack.workers:
            if proc.alive():
                for child in psutil.Process(proc.pid).children(recursive=True):
                    if child.pid in pids:
                        return child.pid, proc
        return None

    def _wait_busy(self, timeout: float = 20) -> tuple[int, Proc] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self._busy_child()
            if found:
                return found
            time.sleep(0.05)
        return None

    def inject(self, kind: str) -> str:
        st = self.stack
        if kind == "kill_child":
            found = self._wait_busy()
            if found is None:
                return "kill_child: no job running"
            os.kill(found[0], signal.SIGKILL)
            return f"kill_child pid {found[0]} (mid-job)"
        if kind == "kill_worker":
            found = self._wait_busy()
            victim = found[1] if found else next(w for w in st.workers if w.alive())
            victim.kill()
            st.start_worker()
            return f"kill_worker {victim.name}{' (mid-job)' if found else ''} (+ replacement)"
        if kind == "kill_api":
            assert st.api is not None
            st.api.kill()
            st.start_api()
            return "kill_api (restarted)"
        if kind == "kill_redis":
            st.redis.kill()
            time.sleep(1)
            st.redis.start()
            return "kill_redis (restarted from AOF)"
        raise ValueError(kind)

    def injector(self, every: float, t0: float) -> None:
        kinds = ["kill_child", "kill_worker", "kill_api", "kill_redis"]
        n = 0
        while not self.stop.wait(every):
            kind = kinds[n % len(kinds)]
            n += 1
            try:
                what = self.inject(kind)
            except Exception as exc:  # report, keep soaking
                what = f"{kind} failed: {exc}"
            with self.lock:
                self.faults.append((round(time.monotonic() - t0, 1), what))
            print(f"[{time.monotonic() - t0:6.1f}s] fault: {what}", flush=True)

    # -- audit ---------------------------------------------------------------------

    def audit(self, drain_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + drain_s
        jobs: dict[str, dict[str, Any]] = {}
        while time.monotonic() < deadline:
            for job_id, key in list(self.accepted.items()):
                if job_id in jobs and jobs[job_id]["status"] in TERMINAL:
                    continue
                try:
                    with httpx.Client(base_url=self.stack.base_url, timeout=10, headers={
                            "Authorization": f"Bearer {API_KEYS[key]}"}) as c:
                        jobs[job_id] = c.get(f"/v1/jobs/{job_id}").json()
                except (httpx.HTTPError, ValueError):
                    pass
            if len(jobs) == len(self.accepted) and all(
                    j.get("status") in TERMINAL for j in jobs.values()):
                break
            time.sleep(1)
        s3c = self.s3.client()
        manifests: Counter[str] = Counter()
        for page in s3c.get_paginator("list_objects_v2").paginate(Bucket=S3_BUCKET,
                                                                  Prefix="jobs/"):
            for o in page.get("Contents", []):
                if o["Key"].endswith("/manifest.json"):
                    manifests[o["Key"].split("/")[1]] += 1
        statuses = Counter(j.get("status", "missing") for j in jobs.values())
        codes = Counter((j.get("error") or {}).get("code") for j in jobs.values()
                        if j.get("status") == "failed")
        lost = [i for i in self.accepted if jobs.get(i, {}).get("status") not in TERMINAL]
        dup = [i for i, n in manifests.items() if n > 1]
        e2e = [ts(j["finished_at"]) - ts(j["created_at"]) for j in jobs.values()
               if j.get("status") == "succeeded" and j.get("finished_at")]
        attempts = Counter(j.get("attempts", 0) for j in jobs.values())
        ok_without_manifest = [i for i, j in jobs.items()
                               if j.get("status") == "succeeded" and manifests[i] != 1]
        return {
            "accepted": len(self.accepted),
            "statuses": dict(statuses),
            "failed_codes": dict(codes),
            "lost_jobs": len(lost),
            "lost_ids": lost[:20],
            "duplicate_runs": len(dup),
            "succeeded_without_exactly_one_manifest": len(ok_without_manifest),
            "attempts_histogram": {str(k): v for k, v in sorted(attempts.items())},
            "submit_ms_p50": round(pct(self.submit_ms, 50), 1),
            "submit_ms_p99": round(pct(self.submit_ms, 99), 1),
            "submit_retries": self.retries,
            "submissions_given_up": self.gave_up,
            "job_latency_s_p50": round(statistics.median(e2e), 1) if e2e else None,
            "job_latency_s_p99": round(pct(e2e, 99), 1) if e2e else None,
            "faults": self.faults,
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--kill-every", type=float, default=30.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--interval", type=float, default=4.0,
                    help="seconds each client waits between submissions")
    ap.add_argument("--drain", type=float, default=300.0,
                    help="seconds to wait for accepted jobs to finish after the soak")
    ap.add_argument("--out", type=Path, default=ROOT / "var" / "reliability" / "soak.json")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="maec-soak-") as tmp:
        root = Path(tmp)
        models = root / "models"
        base = make_llama(models / "base", seed=0)
        donor = make_llama(models / "donor", seed=1, like=base)
        big: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 1024,
                               "num_hidden_layers": 12}
        # bfloat16: a few seconds of combine (a window for the kills) at ~24 MB per output,
        # so a 10-minute soak writes a few GB, not tens.
        big_a = make_llama(models / "big-a", seed=1, tokenizer=False, dtype=torch.bfloat16,
                           **big)
        big_b = make_llama(models / "big-b", seed=2, tokenizer=False, dtype=torch.bfloat16,
                           **big)
        bodies: list[dict[str, Any]] = [
            {"method": "linear", "ability_donor": [str(donor)], "language_base": str(base)},
            {"method": "linear", "ability_donor": [str(donor)], "language_base": str(base)},
            {"recipe": {"merge_method": "ties", "base_model": str(big_b),
                        "models": [{"model": str(big_a),
                                    "parameters": {"weight": 0.5, "density": 0.5}}]}},
        ]
        s3 = S3Server(root / "seaweedfs").start()
        try:
            with stack_context(root / "stack", None, storage="s3", s3=s3,
                               workers=args.workers, local_roots=[models], env=ENV) as st:
                soak = Soak(st, s3, bodies, args.clients, args.interval)
                t0 = time.monotonic()
                threads = [threading.Thread(target=soak.client, args=(i,), daemon=True)
                           for i in range(args.clients)]
                threads.append(threading.Thread(target=soak.injector,
                                                args=(args.kill_every, t0), daemon=True))
                for t in threads:
                    t.start()
                time.sleep(args.minutes * 60)
                soak.stop.set()
                for t in threads:
                    t.join(90)
                print(f"soak over after {time.monotonic() - t0:.0f}s; draining...", flush=True)
                figures = soak.audit(args.drain)
                figures.update({"minutes": args.minutes, "kill_every_s": args.kill_every,
                                "workers": args.workers, "clients": args.clients})
        finally:
            s3.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2) + "\n")
    for k, v in figures.items():
        if k not in ("faults", "lost_ids"):
            print(f"{k}: {v}")
    print(f"figures written to {args.out}")
    ok = figures["lost_jobs"] == 0 and figures["duplicate_runs"] == 0
    print(f"SOAK {'OK' if ok else 'FAILED'} accepted={figures['accepted']} "
          f"lost_jobs={figures['lost_jobs']} duplicate_runs={figures['duplicate_runs']}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
