"""SIGTERM drains a worker, on real processes: it takes no new job, the running one
finishes (or, when the grace period is cut short by SIGKILL, another worker runs it
again), and nothing is lost or run twice.

The signal goes to the worker's main process only, as Kubernetes and ``docker stop``
send it (its merge child is left to finish).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.reliability import helpers as h
from tests.stack import Stack, stack_context, wait_for

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.slow]

LEASE_S = 3
ENV = {"MAEC_LEASE_SECONDS": str(LEASE_S), "MAEC_MAX_ATTEMPTS": "3",
       "MAEC_PROGRESS_INTERVAL": "0.05", "MAEC_MAX_ACTIVE_JOBS_PER_KEY": "1000",
       "MAEC_SUBMISSIONS_PER_MINUTE": "100000"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[Stack]:
    with stack_context(tmp_path_factory.mktemp("drain"), None, workers=1,
                       local_roots=[model_root], env=ENV) as st:
        yield st


def slow_job(big: dict[str, Path], name: str) -> dict[str, Any]:
    return {"recipe": {"merge_method": "ties", "base_model": str(big["b"]),
                       "models": [{"model": str(big["a"]),
                                   "parameters": {"weight": 0.5, "density": 0.5}}],
                       "out_shard_size": "10MB", "name": name}}


def manifests(stack: Stack, job_id: str) -> int:
    """Published manifests of the job, every attempt (local storage)."""
    return len(list((stack.root / "storage" / "jobs" / job_id).glob("*/manifest.json")))


def _live(stack: Stack) -> int:
    return sum(1 for w in stack.workers if w.alive())


def test_sigterm_finishes_the_running_job_and_takes_no_new_one(
        stack: Stack, big: dict[str, Path]) -> None:
    running = stack.submit(slow_job(big, "drain-running"))
    h.wait_record(stack, running["id"], h.combining, 90, "combine stage")
    waiting = stack.submit(slow_job(big, "drain-waiting"))
    worker = next(w for w in stack.workers if w.alive())
    os.kill(worker.pid, signal.SIGTERM)  # the main process only
    done = stack.wait(running["id"], timeout=120)
    assert done["status"] == "succeeded", done["error"]
    assert done["attempts"] == 1  # finished where it ran, not re-run
    wait_for(lambda: not worker.alive(), 60, "the drained worker to exit")
    assert "draining" in worker.tail(20000)
    # The job queued meanwhile was left for another worker: still queued, untouched.
    time.sleep(LEASE_S + 1)
    rec = h.record(stack, waiting["id"])
    assert (rec["status"], rec["attempts"]) == ("queued", 0), rec
    stack.start_worker()
    late = stack.wait(waiting["id"], timeout=120)
    assert late["status"] == "succeeded" and late["attempts"] == 1, late
    lost, dup = h.audit(stack, None, [running["id"], waiting["id"]], h.worker_logs(stack))
    assert (lost, dup) == (0, 0)
    assert [manifests(stack, j["id"]) for j in (running, waiting)] == [1, 1]


def test_a_drain_cut_short_is_run_again_elsewhere_once(stack: Stack,
                                                       big: dict[str, Path]) -> None:
    """The grace period ends mid-merge (SIGTERM, then SIGKILL of the whole worker): the
    lease expires, the job runs again on another worker, and publishes once."""
    while _live(stack) < 2:
        stack.start_worker()
    job = stack.submit(slow_job(big, "drain-cut"))
    rec = h.wait_record(stack, job["id"], h.combining, 90, "combine stage")
    pid = h.child_running(stack, rec)
    owner = next(w for w in stack.workers if w.alive() and pid in
                 {c.pid for c in psutil.Process(w.pid).children(recursive=True)})
    os.kill(owner.pid, signal.SIGTERM)
    time.sleep(0.5)
    owner.kill()  # the grace period is over
    done = stack.wait(job["id"], timeout=180)
    assert done["status"] == "succeeded", done["error"]
    assert done["attempts"] == 2
    lost, dup = h.audit(stack, None, [job["id"]], h.worker_logs(stack))
    assert (lost, dup) == (0, 0) and manifests(stack, job["id"]) == 1
