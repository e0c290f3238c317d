"""Fault injection against real processes: a job ends succeeded exactly once, or failed
with a code; it is never lost.

One stack for the module: its own redis-server (AOF on, so it can be killed and
restarted), SeaweedFS as the object store, two Celery workers and the API. The lease is
short (3 s) so a dead attempt is noticed in seconds, and attempts are capped at 3.
Every test ends with :func:`helpers.audit`, which feeds the lost/duplicate counters.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from app.queue import Enqueuer
from tests.reliability import helpers as h
from tests.reliability import results
from tests.stack import S3_BUCKET, Proc, S3Server, Stack, stack_context, wait_for

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.slow]

LEASE_S = 3
MAX_ATTEMPTS = 3
ENV = {
    "MAEC_LEASE_SECONDS": str(LEASE_S),
    "MAEC_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
    "MAEC_PROGRESS_INTERVAL": "0.05",
    "MAEC_MAX_ACTIVE_JOBS_PER_KEY": "1000",
    "MAEC_SUBMISSIONS_PER_MINUTE": "100000",
    # stack.wait polls 20 times a second: a wait of several seconds would otherwise
    # empty the key's request bucket and the next test's submission get a 429.
    "MAEC_RATE_LIMIT_PER_MINUTE": "100000",
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server,
          model_root: Path) -> Iterator[Stack]:
    with stack_context(tmp_path_factory.mktemp("faults"), None, storage="s3", s3=s3_server,
                       workers=2, local_roots=[model_root], env=ENV) as st:
        yield st


def slow_job(big: dict[str, Path], name: str, shard: str = "10MB") -> dict[str, Any]:
    """A ties merge of the 24-layer models: seconds of combine, ~10 output shards."""
    return {"recipe": {
        "merge_method": "ties", "base_model": str(big["b"]),
        "models": [{"model": str(big["a"]), "parameters": {"weight": 0.5, "density": 0.5}}],
        "out_shard_size": shard, "name": name,
    }}


def quick_job(tiny: dict[str, Path], name: str) -> dict[str, Any]:
    return {"method": "linear", "ability_donor": [str(tiny["a"])],
            "language_base": str(tiny["base"]), "name": name}


def _finish(stack: Stack, s3: S3Server, jobs: list[str]) -> None:
    lost, dup = h.audit(stack, s3, jobs, h.worker_logs(stack))
    assert (lost, dup) == (0, 0), f"lost={lost} duplicate runs={dup}"


def test_worker_sigkill_while_combining(stack: Stack, s3_server: S3Server,
                                        big: dict[str, Path]) -> None:
    job = stack.submit(slow_job(big, "sigkill-combine"))
    rec = h.wait_record(stack, job["id"], h.combining, 60, "combine stage")
    killed = h.kill_child(stack, rec)
    t0 = time.monotonic()
    done = stack.wait(job["id"], timeout=180)
    results.figure("sigkill_combine_recovery_s", round(time.monotonic() - t0, 1))
    assert done["status"] == "succeeded", done["error"]
    assert done["attempts"] == 2, f"killed pid {killed}; attempts {done['attempts']}"
    h.assert_published_once(s3_server, done, h.record(stack, job["id"]))
    _finish(stack, s3_server, [job["id"]])


def test_duplicate_message_is_a_noop(stack: Stack, s3_server: S3Server,
                                     tiny: dict[str, Path]) -> None:
    """The same messages delivered again (while queued, and after success) change
    nothing: a second wake-up of the job's pool and a message naming the job, while it
    is queued or running; two more of the one and one of the other after it succeeded.
    Of the six, one runs the job; the five others end as no-ops."""
    enq = Enqueuer(stack.redis_url)
    empty = "nothing to take"
    spare = h.log_text(stack.workers).count(empty)
    try:
        job = stack.submit(quick_job(tiny, "dup"))
        enq.enqueue(job["id"])  # a copy naming the job, while queued or running
        enq.wake(job["pool"])  # a second wake-up of its pool
        done = stack.wait(job["id"])
        assert done["status"] == "succeeded", done["error"]
        before = h.record(stack, job["id"])
        for _ in range(2):
            enq.enqueue(job["id"])  # redelivery after success
        enq.wake(job["pool"])
        # Every copy is consumed: the worker logs say so, and nothing else changed.
        noop = f"job {job['id']}: not run"

        def noops() -> int:
            text = h.log_text(stack.workers)
            return text.count(noop) + text.count(empty) - spare

        wait_for(lambda: noops() >= 5, 30, "five no-op deliveries")
    finally:
        enq.close()
    after = h.record(stack, job["id"])
    assert after == before
    assert after["attempts"] == 1
    h.assert_published_once(s3_server, done, after)
    _finish(stack, s3_server, [job["id"]])


def test_redis_killed_and_restarted(stack: Stack, s3_server: S3Server,
                                    big: dict[str, Path], tiny: dict[str, Path]) -> None:
    """SIGKILL redis-server with one job running and several queued, restart it from
    its AOF: every job completes, once."""
    running = stack.submit(slow_job(big, "redis-running"))
    queued = [stack.submit(slow_job(big, f"redis-q{i}"))["id"] for i in range(2)]
    queued += [stack.submit(quick_job(tiny, f"redis-t{i}"))["id"] for i in range(4)]
    h.wait_record(stack, running["id"], h.combining, 60, "combine stage")
    # appendfsync everysec (deploy/redis.conf): writes of the last second before a crash
    # may be lost by design; the submissions above are older than that.
    time.sleep(1.2)
    stack.redis.kill()
    t_down = time.monotonic()
    with stack.client() as c:  # the API keeps answering, with a retryable 503
        resp = c.get(f"/v1/jobs/{running['id']}", timeout=15)
    assert resp.status_code == 503, resp.text
    assert resp.json()["code"] == "unavailable" and int(resp.headers["retry-after"]) >= 1
    time.sleep(max(0.0, 2 - (time.monotonic() - t_down)))
    stack.redis.start()
    ids = [running["id"], *queued]
    recs = h.wait_all(stack, ids, 240)
    statuses = {i: r.get("status") for i, r in recs.items()}
    assert all(s == "succeeded" for s in statuses.values()), statuses
    for i in ids:
        with stack.client() as c:
            job = c.get(f"/v1/jobs/{i}").json()
        h.assert_published_once(s3_server, job, recs[i])
    results.figure("redis_restart_jobs", len(ids))
    _finish(stack, s3_server, ids)


def test_api_restart_mid_download_and_during_jobs(stack: Stack, s3_server: S3Server,
                                                  big: dict[str, Path]) -> None:
    # One ~95 MB file: far more than localhost socket buffers hold, so the crash really
    # cuts the stream short.
    done = stack.wait(stack.submit(slow_job(big, "download", "1GB"))["id"], timeout=120)
    assert done["status"] == "succeeded", done["error"]
    entry = max(done["result"]["files"], key=lambda f: f["size"])
    running = [stack.submit(slow_job(big, f"api-restart-{i}"))["id"] for i in range(2)]

    received = bytearray()
    with stack.client() as c, c.stream("GET", entry["url"]) as resp:
        assert resp.status_code == 200
        etag = resp.headers["etag"]
        chunks = resp.iter_raw(256 * 1024)
        while len(received) < 2 * 1024 * 1024:
            received += next(chunks)
        stack.api.kill()  # type: ignore[union-attr]  # a crash, mid-stream
        with pytest.raises(httpx.HTTPError):
            for chunk in chunks:  # what the kernel had buffered, then the broken stream
                received += chunk
    assert 0 < len(received) < entry["size"]
    stack.start_api()

    with stack.client() as c:
        resp = c.get(entry["url"], headers={"Range": f"bytes={len(received)}-"})
    assert resp.status_code == 206
    assert resp.headers["etag"] == etag
    assert resp.headers["content-range"] == (
        f"bytes {len(received)}-{entry['size'] - 1}/{entry['size']}")
    whole = bytes(received) + resp.content
    assert hashlib.sha256(whole).hexdigest() == entry["sha256"]

    recs = h.wait_all(stack, running, 180)
    for i in running:
        assert recs[i]["status"] == "succeeded", recs[i].get("error")
        assert recs[i]["attempts"] == 1  # the API restart did not touch the jobs
    _finish(stack, s3_server, [done["id"], *running])


def test_storage_unreachable_during_publish(stack: Stack, s3_server: S3Server,
                                            big: dict[str, Path]) -> None:
    """The store goes away while the worker waits on its uploads to publish.

    Shards upload while the merge goes on, so by the time the publish stage reports a
    file nearly everything is stored and the outage has no moment left to land in.
    The outage is therefore set up, not raced: the store is frozen once a first shard is
    stored mid-combine (nothing more can complete, the manifest least of all), and
    killed once the merge is done and the worker waits in the publish stage on the
    uploads it holds.
    """
    job = stack.submit(slow_job(big, "storage-down"))

    def first_shard_stored(_rec: dict[str, Any]) -> bool:
        # Listed before the record is read: the shard is stored and the merge is still
        # combining after it, so the manifest is seconds of work away.
        return bool(h.job_keys(s3_server, job["id"])) and h.combining(h.record(stack, job["id"]))

    try:
        h.wait_record(stack, job["id"], first_shard_stored, 90, "a shard stored mid-combine")
        s3_server.freeze()
        h.wait_record(stack, job["id"], lambda r: r.get("stage") == "publish", 90,
                      "the publish stage waiting on the uploads")
        s3_server.kill()
        down_at = time.time()
        done = stack.wait(job["id"], timeout=180)
    finally:
        s3_server.kill()
        s3_server.start()
    finished = datetime.fromisoformat(done["finished_at"].replace("Z", "+00:00"))
    outage = finished.timestamp() - down_at
    results.figure("storage_down_to_failed_s", round(outage, 1))
    assert done["status"] == "failed"
    assert done["error"]["code"] == "storage_unavailable", done["error"]
    assert done["attempts"] == 1
    assert outage < 120, "retries are bounded"
    # No manifest ever; the staging objects written before the outage are removed once
    # the store is back (the worker's janitor retries what the failed attempt could not).
    wait_for(lambda: h.job_keys(s3_server, job["id"]) == [], 60, "staging cleaned")
    _finish(stack, s3_server, [job["id"]])


def test_worker_killed_repeatedly_fails_worker_lost(stack: Stack, s3_server: S3Server,
                                                    big: dict[str, Path]) -> None:
    """Every attempt's worker is SIGKILLed (as the OOM killer would do to a merge over
    its memory budget): after MAEC_MAX_ATTEMPTS the job fails with worker_lost."""
    job = stack.submit(slow_job(big, "killed-repeatedly"))
    for attempt in range(1, MAX_ATTEMPTS + 1):
        def attempt_combining(r: dict[str, Any], a: int = attempt) -> bool:
            return r.get("attempts") == a and h.combining(r)

        rec = h.wait_record(stack, job["id"], attempt_combining, 90,
                            f"attempt {attempt} combining")
        h.kill_child(stack, rec)
    done = stack.wait(job["id"], timeout=120)
    assert done["status"] == "failed"
    assert done["error"]["code"] == "worker_lost", done["error"]
    assert done["attempts"] == MAX_ATTEMPTS
    time.sleep(LEASE_S + 2)  # no further attempt starts: the loop is bounded
    assert h.record(stack, job["id"])["attempts"] == MAX_ATTEMPTS
    assert h.job_keys(s3_server, job["id"]) == []
    _finish(stack, s3_server, [job["id"]])


@contextlib.contextmanager
def only_worker(stack: Stack, env: dict[str, str]) -> Iterator[Proc]:
    """Replace the stack's workers by one configured with ``env``; restore two after.
    Workers stop together and start together (each takes seconds either way)."""
    for w in stack.workers:
        w.terminate()
    for w in stack.workers:
        w.stop()
    special = stack.start_worker(env)
    try:
        yield special
    finally:
        special.terminate()
        restored = [stack.start_worker(wait=False) for _ in range(2)]
        special.stop()
        for w in restored:
            stack.wait_worker(w)


def test_time_limit_fails_with_code(stack: Stack, s3_server: S3Server,
                                    big: dict[str, Path]) -> None:
    """A task past its soft time limit fails with time_limit, once; no requeue loop.

    The worker's child is paused (SIGSTOP) mid-combine past the limit, which is exactly
    what a merge that runs too long looks like to Celery's timer.
    """
    limit = 12
    with only_worker(stack, {"MAEC_TASK_TIME_LIMIT": str(limit), "MAEC_LEASE_SECONDS": "60"}):
        job = stack.submit(slow_job(big, "time-limit"))
        rec = h.wait_record(stack, job["id"], h.combining, 60, "combine stage")
        pid = h.kill_child(stack, rec, signal.SIGSTOP)
        time.sleep(limit - 5 + 1)  # past the soft limit (limit - 5 s), before the hard one
        os.kill(pid, signal.SIGCONT)
        done = stack.wait(job["id"], timeout=60)
        assert done["status"] == "failed"
        assert done["error"]["code"] == "time_limit", done["error"]
        assert done["attempts"] == 1
        time.sleep(3)
        assert h.record(stack, job["id"])["attempts"] == 1
        assert h.job_keys(s3_server, job["id"]) == []
        _finish(stack, s3_server, [job["id"]])


def test_hard_time_limit_is_bounded(stack: Stack, s3_server: S3Server,
                                    big: dict[str, Path]) -> None:
    """A merge that ignores the soft limit (stuck in native code: here, paused for good)
    is killed by Celery at the hard limit; the job fails with time_limit after that one
    attempt and is never requeued."""
    limit = 10
    with only_worker(stack, {"MAEC_TASK_TIME_LIMIT": str(limit)}):
        job = stack.submit(slow_job(big, "hard-time-limit"))
        rec = h.wait_record(stack, job["id"], h.combining, 60, "combine stage")
        pid = h.kill_child(stack, rec, signal.SIGSTOP)  # never resumed
        done = stack.wait(job["id"], timeout=90)
        assert done["status"] == "failed"
        assert done["error"]["code"] == "time_limit", done["error"]
        assert done["attempts"] == 1
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
        time.sleep(LEASE_S + 3)  # a lease's worth and more: no second attempt starts
        assert h.record(stack, job["id"])["attempts"] == 1
        assert h.job_keys(s3_server, job["id"]) == []
        _finish(stack, s3_server, [job["id"]])


def test_delete_mid_download_is_an_error_never_a_short_file(
        stack: Stack, s3_server: S3Server, big: dict[str, Path], tmp_path: Path) -> None:
    """A job deleted while one of its files streams from S3 through the API: the reader
    gets either every byte (a store may finish serving an opened object) or a broken
    stream, never a short body that ends cleanly; and the client, resuming, reports the
    deletion instead of leaving a folder."""
    from maec_client import Client, NotFound
    from tests.stack import API_KEYS

    done = stack.wait(stack.submit(slow_job(big, "delete-mid-download", "1GB"))["id"],
                      timeout=120)
    assert done["status"] == "succeeded", done["error"]
    entry = max(done["result"]["files"], key=lambda f: f["size"])
    received = bytearray()
    broken = False
    with stack.client() as c, c.stream("GET", entry["url"]) as resp:
        assert resp.status_code == 200 and resp.headers["etag"] == f'"{entry["sha256"]}"'
        chunks = resp.iter_raw(256 * 1024)
        while len(received) < 2 * 1024 * 1024:
            received += next(chunks)
        with stack.client() as other:
            assert other.delete(f"/v1/jobs/{done['id']}").status_code == 204
        assert h.job_keys(s3_server, done["id"]) == []
        try:
            for chunk in chunks:
                received += chunk
        except httpx.HTTPError:
            broken = True
    results.add("deletes_mid_download")
    results.figure("delete_mid_download_stream", "broken" if broken else "complete")
    whole = len(received) == entry["size"]
    if not broken and not (whole and hashlib.sha256(received).hexdigest() == entry["sha256"]):
        results.add("corrupt_downloads")
    assert broken or whole, f"a clean end after {len(received)} of {entry['size']} bytes"
    dest = tmp_path / "out"
    with Client(stack.base_url, API_KEYS["alice"], max_retries=0) as client, \
            pytest.raises(NotFound):
        # The job as the client saw it before the delete: its file list, now all gone.
        client.download(_job_model(done), dest)
    assert not dest.exists()


def _job_model(job: dict[str, Any]) -> Any:
    from maec_client.models import Job

    return Job.model_validate(job)


def test_sigkilled_merge_resumes_from_its_published_shards(stack: Stack, s3_server: S3Server,
                                                           big: dict[str, Path]) -> None:
    """A worker SIGKILLed mid-merge after some of its shards landed: the next attempt
    verifies them, makes only the others (one recorded shard is tampered with while no
    worker runs the job: it is made again, not trusted), and the result is an
    uninterrupted run's byte for byte, one manifest, nothing stray."""
    body = slow_job(big, "resumed", shard="5MB")
    job = stack.submit(body)

    def shards_landed(r: dict[str, Any]) -> bool:
        return h.combining(r) and len((r.get("shards") or {}).get("files") or {}) >= 3

    rec = h.wait_record(stack, job["id"], shards_landed, 90, "three shards recorded")
    h.kill_child(stack, rec)
    recorded = h.record(stack, job["id"])["shards"]
    prefix, landed = recorded["prefix"], sorted(recorded["files"])
    tampered = landed[0]
    c = s3_server.client()
    key = f"{prefix}/{tampered}"
    data = bytearray(c.get_object(Bucket=S3_BUCKET, Key=key)["Body"].read())
    data[-1] ^= 0xFF  # same size, one byte off: only the digest can tell
    c.put_object(Bucket=S3_BUCKET, Key=key, Body=bytes(data))
    resumed = h.wait_record(stack, job["id"], lambda r: r.get("attempts") == 2 and bool(
        (r.get("progress") or {}).get("resumed")), 60, "the second attempt resuming")
    note = resumed["progress"]["resumed"]
    assert note["shards"] == len(landed) - 1, note
    # Progress starts at the resumed part (ties: combine covers 0.05 to 0.95 of the job).
    assert resumed["progress"]["fraction"] >= 0.05 + 0.9 * note["shards"] / note["of"] - 1e-3
    done = stack.wait(job["id"], timeout=180)
    assert done["status"] == "succeeded", done["error"]
    assert done["attempts"] == 2
    assert done["progress"]["resumed"] == note  # the finished job (its webhook) says so
    after = h.record(stack, job["id"])
    assert after["result_prefix"] == prefix  # the first attempt's shards were kept
    h.assert_published_once(s3_server, done, after)
    # The second attempt stored exactly the shards that were not verified.
    mark = f"job {job['id']} attempt 2: shard "
    stored = {line.split(mark, 1)[1].split(" ", 1)[0]
              for line in h.log_text(stack.workers).splitlines() if mark in line}
    shards = {f["path"] for f in done["result"]["files"] if f["path"].endswith(".safetensors")}
    assert stored == shards - set(landed[1:]), sorted(stored)
    # Byte for byte an uninterrupted run's, the redone shard included.
    whole = stack.wait(stack.submit(body)["id"], timeout=180)
    assert whole["status"] == "succeeded", whole["error"]
    want = {f["path"]: f["sha256"] for f in whole["result"]["files"]}
    assert {f["path"]: f["sha256"] for f in done["result"]["files"]} == want
    fixed = c.get_object(Bucket=S3_BUCKET, Key=key)["Body"].read()
    assert hashlib.sha256(fixed).hexdigest() == want[tampered]
    _finish(stack, s3_server, [job["id"], whole["id"]])
