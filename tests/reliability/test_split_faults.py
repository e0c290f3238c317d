"""Faults during a split merge (parts on two workers, worker/split.py): a worker SIGKILLed
mid-part, and a cancel while the parts run. Nothing is lost, no part is run twice to
completion, and the split result is the unsplit merge's byte for byte."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from app.jobs.parts import parts_key
from tests.reliability import helpers as h
from tests.reliability import results
from tests.reliability.test_faults import ENV, slow_job
from tests.stack import TERMINAL, S3Server, Stack, stack_context, wait_for

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server,
          model_root: Path) -> Iterator[Stack]:
    env = {**ENV, "MAEC_SPLIT_ABOVE_BYTES": "1", "MAEC_SPLIT_PARTS": "2"}
    with stack_context(tmp_path_factory.mktemp("split"), None, storage="s3", s3=s3_server,
                       workers=2, local_roots=[model_root], env=env) as st:
        yield st


def parts(stack: Stack, job_id: str) -> list[dict[str, Any]]:
    r = redis.Redis.from_url(stack.redis_url, socket_timeout=2)
    try:
        raw = cast(dict[bytes, bytes], r.hgetall(parts_key(job_id)))
    finally:
        r.close()
    n = int(raw.get(b"n", b"0"))
    return [json.loads(raw[f"p{i}".encode()]) for i in range(n)]


def _mid_part(stack: Stack, job_id: str, helper: bool = True) -> dict[str, Any] | None:
    """A part that a helper (not the job's own attempt; with ``helper`` False, anyone)
    runs, once one shard of it landed."""
    owner = h.record(stack, job_id).get("worker")
    for p in parts(stack, job_id):
        if p["state"] == "running" and p.get("shards") and (
                not helper or p["owner"] != owner):
            return p
    return None


def _done_once(stack: Stack, job_id: str) -> None:
    text = h.log_text(stack.workers)
    for i in range(2):
        assert text.count(f"job {job_id}: part {i} done") == 1, i


def test_worker_killed_mid_part_is_taken_over_and_resumed(stack: Stack,
                                                           s3_server: S3Server,
                                                           big: dict[str, Path]) -> None:
    body = slow_job(big, "split-kill", shard="5MB")
    job = stack.submit(body)
    part = wait_for(lambda: _mid_part(stack, job["id"]), 90, "a helper's part")
    h.kill_child(stack, {"worker": part["owner"]})
    t0 = time.monotonic()
    done = stack.wait(job["id"], timeout=240)
    results.figure("split_sigkill_part_recovery_s", round(time.monotonic() - t0, 1))
    assert done["status"] == "succeeded", done["error"]
    assert done["attempts"] == 1  # the job's own attempt was not the one killed
    _done_once(stack, job["id"])
    h.assert_published_once(s3_server, done, h.record(stack, job["id"]))
    # Every shard is the one its part recorded (tests/api/test_split.py compares a split
    # job's bytes with an unsplit one's).
    shards = {f["path"]: f["sha256"] for f in done["result"]["files"]
              if f["path"].endswith(".safetensors")}
    assert len(shards) >= 4
    lost, dup = h.audit(stack, s3_server, [job["id"]], h.worker_logs(stack))
    assert (lost, dup) == (0, 0), f"lost={lost} duplicate runs={dup}"


def test_cancel_while_parts_run_leaves_nothing(stack: Stack, s3_server: S3Server,
                                               big: dict[str, Path]) -> None:
    job = stack.submit(slow_job(big, "split-cancel", shard="5MB"))
    # Whoever runs it: the other worker may still be busy with the previous test's
    # redelivered helper message.
    wait_for(lambda: _mid_part(stack, job["id"], helper=False), 90, "a part running")
    r = stack.client().post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code in (200, 202), r.text
    done = stack.wait(job["id"], timeout=120)
    assert done["status"] == "cancelled", done
    time.sleep(1)  # a helper's last upload, had it outlived the clean-up, lands here
    assert not h.job_keys(s3_server, job["id"])
    assert not parts(stack, job["id"])
    lost, dup = h.audit(stack, s3_server, [job["id"]], h.worker_logs(stack))
    assert (lost, dup) == (0, 0)


# The faulted jobs below keep this name, so every file they publish (the card included)
# is the uninterrupted run's byte for byte.
REDIS_JOB = "split-redis"


@pytest.fixture(scope="module")
def uninterrupted(stack: Stack, big: dict[str, Path]) -> dict[str, str]:
    """path -> sha256 of the same split merge run with no fault."""
    done = stack.wait(stack.submit(slow_job(big, REDIS_JOB, shard="5MB"))["id"],
                      timeout=120)
    assert done["status"] == "succeeded", done["error"]
    return {f["path"]: f["sha256"] for f in done["result"]["files"]}


def _states(stack: Stack, job_id: str) -> list[str]:
    return [p["state"] for p in parts(stack, job_id)]


def _check_after_restart(stack: Stack, s3_server: S3Server, job_id: str,
                         expected: dict[str, str]) -> None:
    done = stack.wait(job_id, timeout=120)
    assert done["status"] == "succeeded", done["error"]
    assert done["attempts"] == 1  # nothing was taken over: the restart lost no lease
    assert {f["path"]: f["sha256"] for f in done["result"]["files"]} == expected
    _done_once(stack, job_id)
    h.assert_published_once(s3_server, done, h.record(stack, job_id))
    assert not parts(stack, job_id)
    lost, dup = h.audit(stack, s3_server, [job_id], h.worker_logs(stack))
    assert (lost, dup) == (0, 0), f"lost={lost} duplicate runs={dup}"


def test_redis_restarted_while_parts_run(stack: Stack, s3_server: S3Server,
                                         big: dict[str, Path],
                                         uninterrupted: dict[str, str]) -> None:
    """Redis stopped and started again (its AOF, deploy/redis.conf, as the stack runs
    it) once a part is done and another still runs: every worker rides through the
    outage, the parts' state survives it, and the job ends as the uninterrupted run."""
    job = _with_one_part_done(stack, big)
    stack.restart_redis()
    _check_after_restart(stack, s3_server, job["id"], uninterrupted)


def _with_one_part_done(stack: Stack, big: dict[str, Path], tries: int = 4
                        ) -> dict[str, Any]:
    """A split job with one part done and the other still running. The two parts run
    side by side on two workers and often end within the same few milliseconds (their
    last step is the same upload); then the moment is missed, the job ends, and another
    is submitted."""
    for _ in range(tries):
        job = stack.submit(slow_job(big, REDIS_JOB, shard="5MB"))

        def seen(job_id: str = job["id"]) -> str | None:
            states = sorted(_states(stack, job_id))
            if states == ["done", "running"]:
                return "one done"
            if states == ["done", "done"] or h.record(stack, job_id).get("status") in TERMINAL:
                return "missed"
            return None

        if wait_for(seen, 90, "one part done", interval=0.005) == "one done":
            return job
        assert stack.wait(job["id"])["status"] == "succeeded"
    raise AssertionError(f"no part of {tries} split jobs ended before the other")


def test_redis_restarted_between_the_last_part_and_the_final_step(
        stack: Stack, s3_server: S3Server, big: dict[str, Path],
        uninterrupted: dict[str, str]) -> None:
    """The coordinator is paused (SIGSTOP) as the last part is marked done (seen within
    20 ms; the coordinator looks every 0.2 s, so it is paused before its final step or
    at its very start, the job still running); Redis restarts meanwhile. Resumed, it
    finds every part done, writes the index, card and manifest, and publishes once."""
    job = stack.submit(slow_job(big, REDIS_JOB, shard="5MB"))
    wait_for(lambda: "done" in _states(stack, job["id"]), 90, "a part done")
    rec = h.record(stack, job["id"])
    pid = wait_for(lambda: _states(stack, job["id"]) == ["done", "done"]
                   and h.kill_child(stack, rec, signal.SIGSTOP), 60, "every part done",
                   interval=0.01)
    try:
        assert h.record(stack, job["id"])["status"] == "running"
        stack.restart_redis()
    finally:
        os.kill(pid, signal.SIGCONT)
    _check_after_restart(stack, s3_server, job["id"], uninterrupted)


def _with_a_helper_part(stack: Stack, big: dict[str, Path], tries: int = 3
                        ) -> dict[str, Any]:
    """A split job submitted and running, a helper's part of it under way. On a loaded
    machine the helper's message can be picked up only after the job's own attempt has
    run every part; then the job ends without one, and another is submitted."""
    for _ in range(tries):
        job = stack.submit(slow_job(big, REDIS_JOB, shard="5MB"))

        def seen(job_id: str = job["id"]) -> str | None:
            if _mid_part(stack, job_id):
                return "helper"
            return "ended" if h.record(stack, job_id).get("status") in TERMINAL else None

        if wait_for(seen, 90, "a helper's part or the job's end") == "helper":
            return job
        assert stack.wait(job["id"])["status"] == "succeeded"
    raise AssertionError(f"no helper ran a part of {tries} split jobs")


def test_sigterm_drains_the_workers_running_parts(stack: Stack, s3_server: S3Server,
                                                  big: dict[str, Path],
                                                  uninterrupted: dict[str, str]) -> None:
    """SIGTERM to the main process of both workers once a helper's part has a shard
    recorded (the job's own attempt runs its part or waits for the helper's): the helper
    finishes its part where it runs (no part taken over), the job's own worker finishes
    the job, it publishes once, and both workers exit."""
    job = _with_a_helper_part(stack, big)
    drained = [w for w in stack.workers if w.alive()]
    try:
        for w in drained:
            os.kill(w.pid, signal.SIGTERM)  # the main process only, as Kubernetes sends it
        done = stack.wait(job["id"], timeout=120)
        assert done["status"] == "succeeded", done["error"]
        assert done["attempts"] == 1
        assert {f["path"]: f["sha256"] for f in done["result"]["files"]} == uninterrupted
        _done_once(stack, job["id"])
        text = h.log_text(stack.workers)
        assert f"job {job['id']}: part 0 (" in text and f"job {job['id']}: part 1 (" in text
        for i in range(2):  # each part ran once, as attempt 1: nobody took one over
            assert text.count(f"job {job['id']}: part {i} (") == 1, i
        wait_for(lambda: not any(w.alive() for w in drained), 60, "the drained workers")
        assert all("draining" in w.tail(50000) for w in drained)
        h.assert_published_once(s3_server, done, h.record(stack, job["id"]))
        lost, dup = h.audit(stack, s3_server, [job["id"]], h.worker_logs(stack))
        assert (lost, dup) == (0, 0)
    finally:
        for w in drained:
            w.stop()
        for _ in drained:  # for whatever runs next on this stack; ready in seconds
            stack.start_worker(wait=False)
