"""Helpers shared by the reliability tests: raw job records, worker children, storage
audits (lost jobs, duplicate runs, stray staging objects)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

import psutil
import redis

from tests.reliability import results
from tests.stack import S3_BUCKET, TERMINAL, Proc, S3Server, Stack, wait_for


def record(stack: Stack, job_id: str) -> dict[str, Any]:
    """The job's full Redis record (internal fields included), decoded."""
    r = redis.Redis.from_url(stack.redis_url, socket_timeout=2)
    try:
        raw = cast(dict[bytes, bytes], r.hgetall(f"maec:job:{job_id}"))
    finally:
        r.close()
    return {k.decode(): json.loads(v) for k, v in raw.items()}


def wait_record(stack: Stack, job_id: str, pred: Callable[[dict[str, Any]], bool],
                timeout: float, what: str, interval: float = 0.02) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        rec = record(stack, job_id)
        return rec if rec and pred(rec) else None

    try:
        return dict(wait_for(check, timeout, what, interval=interval))
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}\nrecord: {record(stack, job_id)}\nworker logs:\n"
                           + "\n".join(w.tail(3000) for w in stack.workers)) from None


def combining(rec: dict[str, Any]) -> bool:
    p = rec.get("progress") or {}
    return (rec.get("status") == "running" and rec.get("stage") == "combine"
            and 0 < p.get("done", 0) < p.get("total", 0))


def child_running(stack: Stack, rec: dict[str, Any]) -> int:
    """The pid of the pool child that runs the job ``rec`` (its ``worker`` field is
    ``host:<native thread id>``, which for the child's main thread is its pid)."""
    pid = int(str(rec["worker"]).rsplit(":", 1)[1])
    ours = {c.pid for w in stack.workers if w.alive()
            for c in psutil.Process(w.pid).children(recursive=True)}
    assert pid in ours, f"job runs in pid {pid}, not a child of this stack's workers {ours}"
    return pid


def kill_child(stack: Stack, rec: dict[str, Any], sig: int = signal.SIGKILL) -> int:
    pid = child_running(stack, rec)
    os.kill(pid, sig)
    return pid


def job_keys(s3: S3Server, job_id: str) -> list[str]:
    """Every object under the job's storage prefix (all attempts)."""
    c = s3.client()
    keys: list[str] = []
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=S3_BUCKET,
                                                            Prefix=f"jobs/{job_id}/"):
        keys += [o["Key"] for o in page.get("Contents", [])]
    return sorted(keys)


def assert_published_once(s3: S3Server, job: dict[str, Any], rec: dict[str, Any]) -> None:
    """Exactly one manifest, and nothing under the job's prefix but the files it lists."""
    keys = job_keys(s3, job["id"])
    manifests = [k for k in keys if k.endswith("/manifest.json")]
    assert len(manifests) == 1, manifests
    prefix = rec["result_prefix"]
    expected = sorted(f"{prefix}/{f['path']}" for f in job["result"]["files"])
    assert keys == expected, f"stray objects: {sorted(set(keys) - set(expected))}"


def log_text(procs: Iterable[Proc]) -> str:
    return "\n".join(p.log_path.read_text(errors="replace") for p in procs
                     if p.log_path.exists())


def audit(stack: Stack, s3: S3Server | None, job_ids: Iterable[str],
          logs: Iterable[Path] = ()) -> tuple[int, int]:
    """(lost, duplicate runs) over ``job_ids``, added to the suite's counters.

    Lost: no record, or not in a terminal state. Duplicate run: more than one manifest
    under the job's prefix (two attempts both published), or a worker log line saying a
    finished attempt could not mark its job (its run to completion was discarded).
    """
    ids = list(job_ids)
    text = "\n".join(p.read_text(errors="replace") for p in logs if p.exists())
    lost = duplicates = 0
    for job_id in ids:
        rec = record(stack, job_id)
        if not rec or rec.get("status") not in TERMINAL:
            lost += 1
            continue
        manifests = ([k for k in job_keys(s3, job_id) if k.endswith("/manifest.json")]
                     if s3 is not None else [])
        if len(manifests) > 1 or f"job {job_id}: could not mark succeeded" in text:
            duplicates += 1
    results.add("lost_jobs", lost)
    results.add("duplicate_runs", duplicates)
    return lost, duplicates


def wait_all(stack: Stack, job_ids: Iterable[str], timeout: float) -> dict[str, dict[str, Any]]:
    """Records of every job once all are terminal (or whatever they are at the deadline)."""
    ids = list(job_ids)
    deadline = time.monotonic() + timeout
    recs: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        recs = {i: record(stack, i) for i in ids}
        if all(r.get("status") in TERMINAL for r in recs.values()):
            break
        time.sleep(0.2)
    return recs


def worker_logs(stack: Stack) -> list[Path]:
    return [w.log_path for w in stack.workers]


def succeeded_linear_job(stack: Stack, tiny: dict[str, Path], key: str) -> dict[str, Any]:
    """A small linear merge submitted with ``key`` and waited for: the victim's job in
    the tests where another key goes after its outputs."""
    job = stack.submit({"method": "linear", "ability_donor": [str(tiny["a"])],
                        "language_base": str(tiny["base"])}, key=key)
    done = stack.wait(job["id"], key=key)
    assert done["status"] == "succeeded", done["error"]
    return done
