"""The worker's face of the job store (sync Redis): claim, progress, transitions, and the
heartbeat's upkeep (live workers, expired leases, orphaned staging prefixes).

Every write is guarded by the attempt number the claim returned, so a worker that lost
its lease (and whose job a redelivered message re-claimed) cannot overwrite the record.
The scripts and their arguments are those of :mod:`app.jobs.calls`, shared with the API.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import redis

from app.jobs import calls, scripts
from app.jobs.calls import Call, Claim
from app.jobs.keys import ORPHANS_KEY, WORKERS_KEY, job_key, requeue_key, status_key
from app.jobs.record import JobRecord, decode, text
from app.storage.base import Storage, StorageError

T = TypeVar("T")
log = logging.getLogger("maec.worker.store")
# A worker killed without a clean shutdown never removes itself from the live set.
_FORGET_WORKER_AFTER_S = 86400


class WorkerJobStore:
    def __init__(self, client: redis.Redis) -> None:
        self._r = client
        self._scripts = {s.name: client.register_script(s.lua) for s in scripts.ALL}

    @classmethod
    def from_url(cls, url: str) -> WorkerJobStore:
        return cls(redis.Redis.from_url(url, health_check_interval=30))

    def close(self) -> None:
        self._r.close()

    def _run(self, call: Call[T]) -> T:
        return call.parse(self._scripts[call.script.name](keys=call.keys, args=call.args))

    def get(self, job_id: str) -> JobRecord | None:
        return decode(cast(dict[bytes, bytes], self._r.hgetall(job_key(job_id))))

    def claim(
        self, job_id: str, *, worker: str, lease_s: float, max_attempts: int,
        time_limit_s: float = float("inf"),
    ) -> Claim:
        return self._run(calls.claim(job_id, worker=worker, lease_s=lease_s,
                                     max_attempts=max_attempts, time_limit_s=time_limit_s))

    def update(self, job_id: str, attempt: int, fields: dict[str, Any]) -> int:
        """Write ``fields`` if ``attempt`` still owns the job. 1 = cancel requested,
        0 = carry on, -1 = the job is no longer ours."""
        return self._run(calls.update(job_id, attempt, fields))

    def transition(
        self,
        job_id: str,
        *,
        allowed: tuple[str, ...],
        to: str,
        attempt: int | None,
        fields: dict[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> tuple[bool, str]:
        """Atomically move the job from one of ``allowed`` to ``to``; (done, previous)."""
        return self._run(calls.transition(job_id, allowed=allowed, to=to, attempt=attempt,
                                          fields=fields, metrics=metrics))

    def cancel_requested(self, job_id: str) -> bool:
        flag = cast(bytes | None, self._r.hget(job_key(job_id), "cancel_requested"))
        return flag is not None and text(flag) == "true"

    def heartbeat(self, worker: str) -> None:
        now = time.time()
        pipe = self._r.pipeline(transaction=False)
        pipe.zadd(WORKERS_KEY, {worker: now})
        pipe.zremrangebyscore(WORKERS_KEY, "-inf", now - _FORGET_WORKER_AFTER_S)
        pipe.execute()

    def forget_worker(self, worker: str) -> None:
        self._r.zrem(WORKERS_KEY, worker)

    def expired_jobs(self, now: float) -> list[str]:
        """Jobs running or publishing whose lease ended before ``now``."""
        out: list[str] = []
        for status in ("running", "publishing"):
            members = cast(list[bytes], self._r.zrange(status_key(status), 0, -1))
            ids = [text(i) for i in members]
            if not ids:
                continue
            pipe = self._r.pipeline(transaction=False)
            for i in ids:
                pipe.hget(job_key(i), "lease_until")
            leases: list[Any] = pipe.execute()
            out += [i for i, lease in zip(ids, leases, strict=True)
                    if lease is not None and float(lease) < now]
        return out

    def sweep_expired(self, enqueue: Callable[[str], None], *, marker_ttl_s: int
                      ) -> list[str]:
        """Re-enqueue jobs whose lease expired (their worker died); the ids enqueued.

        Celery alone would redeliver an unacknowledged message only after the visibility
        timeout (hours, since it must exceed the longest merge). The lease is the faster
        signal; re-enqueueing is harmless because the claim decides, and a per-job
        ``SET NX`` marker living ``marker_ttl_s`` keeps every live worker from enqueueing
        the same job at once.
        """
        requeued = []
        for job_id in self.expired_jobs(time.time()):
            if self._r.set(requeue_key(job_id), "1", nx=True, ex=marker_ttl_s):
                enqueue(job_id)
                log.warning("job %s: lease expired, re-enqueued", job_id)
                requeued.append(job_id)
        return requeued

    def remember_orphan(self, prefix: str) -> None:
        """Record a staging ``prefix`` a failed attempt could not delete.

        When publishing fails because the object store is unreachable, the attempt's
        cleanup fails for the same reason; every worker's heartbeat then retries the
        deletion (:meth:`clean_orphans`) until the store answers, so an outage never
        leaves half-published files behind. Only failed attempts' own prefixes belong
        here: nothing a reader could trust (a succeeded job's manifest) lives under them.
        Best effort: Redis may be down too.
        """
        try:
            self._r.sadd(ORPHANS_KEY, prefix)
        except redis.RedisError as exc:
            log.error("cannot record orphaned staging prefix %s: %s", prefix, exc)

    def clean_orphans(self, storage: Storage) -> list[str]:
        """Delete every remembered prefix the store now accepts; returns those removed."""
        removed: list[str] = []
        for raw in cast(set[bytes], self._r.smembers(ORPHANS_KEY)):
            prefix = text(raw)
            try:
                storage.delete_prefix(prefix)
            except StorageError as exc:
                log.info("staging %s still not deletable: %s", prefix, exc.message)
                break  # the store is still down; the next heartbeat tries again
            self._r.srem(ORPHANS_KEY, prefix)
            removed.append(prefix)
            log.info("removed orphaned staging %s", prefix)
        return removed
