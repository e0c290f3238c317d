"""The job-level side of ``bench.sweep``: the sweep and its candidates as real jobs.

One stack (``tests.stack.stack_context``: its own redis-server, one Celery worker with
concurrency 1, the uvicorn API, local-directory storage) serves every job. A job's wall is
measured by the client, from sending ``POST /v1/jobs`` to the first ``GET`` that shows it
terminal (polled every ``POLL_S``), so it holds everything a caller waits for: submission
checks, queueing, the worker claiming the job in a fresh child, fetching its inputs into
the worker's cache, merging, evaluating, publishing (checksums, manifest, model card, eval
report) and the status writes. The record's own ``created_at`` -> ``finished_at`` is
checked against it.

Where a job's time goes: the POST (``submit``), then the phases the poller sees, timed
from the first poll that shows each: ``queued`` (until a worker child claims it), the
record's ``stage`` while running (``fetch``, ``extract``, ``combine``, ``evaluate``: a
stage shows once its first progress is written, so loading a model for evaluation counts
in the stage before), and ``publish``; beside them the engine's own seconds as the
record gives them (``core_seconds``).
"""

from __future__ import annotations

import shutil
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from tests.stack import API_KEYS, TERMINAL, Stack, stack_context

POLL_S = 0.02
JOB_TIMEOUT_S = 600.0
# Slack of the check that the client's wall and the record's span agree: timestamps
# in milliseconds, taken by another process's clock.
AGREE_S = 0.02
# Settings the test stack shortens, put back to the service's defaults (app/settings.py):
# a benchmark measures what a deployment runs, not a test's faster heartbeats.
DEFAULTS = ("progress_interval", "worker_heartbeat_seconds", "lease_seconds")
# The per-key request limit would answer the 20 ms poller with 429s: raised for the
# benchmark's one client, which waits on one job at a time.
ENV_BENCH = {"MAEC_RATE_LIMIT_PER_MINUTE": "600000", "MAEC_RATE_LIMIT_BURST": "10000"}


@dataclass
class JobRun:
    """One job as its client saw it."""

    job: dict[str, Any]
    wall: float  # POST sent -> terminal status seen
    post: float  # the POST's round trip (validation, source checks, queueing)
    record: float  # the record's created_at -> finished_at
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def engine(self) -> float:
        """The engine's own seconds (the record's ``core_seconds``): the merge of a plain
        job (its evaluation not included), the whole sweep (merges and evaluations)."""
        return float(self.job["result"]["core_seconds"])


def service_env(threads: int) -> dict[str, str]:
    from app.settings import Settings, env_name

    env = {env_name(name): str(Settings.model_fields[name].default) for name in DEFAULTS}
    return {**env, **ENV_BENCH, "OMP_NUM_THREADS": str(threads)}


@contextmanager
def started_stack(root: Path, models: Path, threads: int) -> Iterator[Stack]:
    """The stack, reading inputs from ``models``; stopped (every process) on exit."""
    with stack_context(root, None, storage="local", workers=1, local_roots=[models],
                       env=service_env(threads)) as stack:
        stack.wait_ready()
        yield stack


class Client:
    """Submits jobs one at a time and follows each to its end."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.http = httpx.Client(base_url=stack.base_url, timeout=60, headers={
            "Authorization": f"Bearer {API_KEYS['alice']}"})
        self.done: list[str] = []

    def close(self) -> None:
        self.http.close()

    def run(self, body: dict[str, Any]) -> JobRun:
        """Submit ``body``, poll until terminal; a job that did not succeed raises."""
        t0 = time.perf_counter()
        r = self.http.post("/v1/jobs", json=body)
        post = time.perf_counter() - t0
        if r.status_code != 202:
            raise RuntimeError(f"submission refused ({r.status_code}): {r.text}")
        job_id = r.json()["id"]
        phases: dict[str, float] = defaultdict(float)
        phase, since = "queued", t0 + post
        asked = last = t0
        while True:
            # ``last``: when the latest poll that still saw the job unfinished was sent.
            last, asked = asked, time.perf_counter()
            job = self.http.get(f"/v1/jobs/{job_id}").json()
            now = time.perf_counter()
            seen = _phase(job)
            if seen != phase:
                phases[phase] += now - since
                phase, since = seen, now
            if job["status"] in TERMINAL:
                break
            if now - t0 > JOB_TIMEOUT_S:
                raise TimeoutError(f"job {job_id} still {job['status']} after "
                                   f"{JOB_TIMEOUT_S:.0f} s")
            time.sleep(POLL_S)
        self.done.append(job_id)
        if job["status"] != "succeeded":
            raise RuntimeError(f"job {job_id} {job['status']}: {job['error']}\n"
                               + "\n".join(w.tail() for w in self.stack.workers))
        run = JobRun(job, now - t0, post, _seconds(job["created_at"], job["finished_at"]),
                     dict(phases))
        _check_agree(run, seen_within=now - last)
        return run

    def forget(self) -> None:
        """Delete every job run so far (its published files with it), so storage does
        not fill and no job's outputs hold references to its artifacts."""
        for job_id in self.done:
            r = self.http.delete(f"/v1/jobs/{job_id}")
            if r.status_code not in (204, 404):
                raise RuntimeError(f"DELETE {job_id}: {r.status_code} {r.text}")
        self.done.clear()


def clear_artifacts(stack: Stack) -> None:
    """Remove every stored ability vector: from storage (``artifacts/``, the prefix the
    service keeps them under, app/artifacts.py) and the worker's local copies (which it
    would drop on its next read of a key storage lacks; removed here so every run
    starts from the same disk). The service has no API for it (the retention sweep
    only collects artifacts unused for days). Called between jobs, never during one, so
    the worker holds none of them open."""
    from app.artifacts import PREFIX

    for folder in (stack.root / "storage" / PREFIX, stack.root / "work" / "artifacts"):
        shutil.rmtree(folder, ignore_errors=True)


def service_cpu(stack: Stack) -> float:
    """CPU seconds the stack's processes have used so far: the API, Redis and each
    Celery worker, with their children (the worker's pool children that have ended are
    counted in its ``children_*`` times, the live ones directly)."""
    import psutil

    roots = [p for p in (stack.api, stack.redis.proc, *stack.workers) if p is not None]
    total = 0.0
    for root in roots:
        proc = psutil.Process(root.pid)
        for p in [proc, *proc.children(recursive=True)]:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                # Ended between listing and reading: its parent counts it once reaped.
                continue
            total += t.user + t.system + t.children_user + t.children_system
    return total


def _check_agree(run: JobRun, seen_within: float) -> None:
    """The client's wall holds the record's span, and exceeds it by no more than the
    record could not see: the record is created during the POST, and ends between the
    last poll that saw it running being sent and the one that saw it ended returning
    (``seen_within``), so ``0 <= wall - record <= post + seen_within``."""
    extra = run.wall - run.record
    if not -AGREE_S <= extra <= run.post + seen_within + AGREE_S:
        raise RuntimeError(
            f"job {run.job['id']}: the client's wall ({run.wall:.3f} s) and the record's "
            f"created -> finished ({run.record:.3f} s) disagree: {extra:.3f} s apart, "
            f"outside 0..{run.post + seen_within:.3f} s (POST {run.post:.3f} s, "
            f"end seen within {seen_within:.3f} s)")


def _phase(job: dict[str, Any]) -> str:
    """What the job is doing as the poller sees it."""
    status = job["status"]
    if status == "running":
        return str(job["stage"] or "running")
    return "publish" if status == "publishing" else str(status)


def _seconds(start: str, end: str) -> float:
    """Seconds between two of the record's ISO timestamps (milliseconds, UTC)."""
    return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()


def sweep_body(data: dict[str, Any]) -> dict[str, Any]:
    """The sweep as one job: the recipe with its ``sweep:`` block, the winner published."""
    return {"recipe": {**data, "sweep": {**data["sweep"], "publish": "best"}}}


def candidate_bodies(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each candidate of the sweep as its own job: its concrete recipe (no sweep), with
    the same eval sets."""
    from maec_core.parsing import parse_recipe
    from maec_core.sweep.grid import candidates

    bodies = {}
    for cand in candidates(parse_recipe(data)):
        recipe = cand.recipe.model_dump(mode="json", exclude_none=True, by_alias=True)
        bodies[cand.id] = {"recipe": {**recipe, "evaluate": data["evaluate"]}}
    return bodies


def groups(data: dict[str, Any]) -> int:
    """How many ability vectors the grid needs (candidates with equal extraction
    parameters share one): what a sweep from an empty store extracts."""
    from maec_core.parsing import parse_recipe
    from maec_core.sweep.grid import candidates

    return len({c.group for c in candidates(parse_recipe(data))})


def sweep_scores(run: JobRun) -> dict[str, dict[str, float]]:
    return {row["id"]: row["scores"] for row in run.job["result"]["sweep"]["rows"]}


def merged_scores(run: JobRun) -> dict[str, float]:
    """The evaluated output's row of a plain job's evaluation table."""
    rows = run.job["result"]["evaluation"]["table"]["rows"]
    (row,) = [r for r in rows if r["model"] == "merged"]
    return {k: float(v) for k, v in row["cells"].items()}
