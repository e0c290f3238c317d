"""The worker's face of the job store (sync Redis): claim, progress, transitions, and the
heartbeat's upkeep (live workers, expired leases, orphaned staging prefixes, and the
retention sweep: expired jobs and unreferenced ability artifacts).

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
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from app.jobs import calls, scripts
from app.jobs.calls import Call, Claim, RemoveOutcome, ReserveOutcome, Taken
from app.jobs.keys import (
    ORPHANS_KEY,
    RETENTION_LOCK_KEY,
    SCHED_HOLDS_KEY,
    UNREFERENCED_KEY,
    WORKERS_KEY,
    job_key,
    requeue_key,
    sched_owners_key,
    sched_queue_key,
    sched_topup_key,
    sched_workers_key,
    status_key,
)
from app.jobs.parts import PartStore
from app.jobs.record import TERMINAL, JobRecord, decode, text
from app.storage.base import Storage, StorageError

T = TypeVar("T")
log = logging.getLogger("maec.worker.store")
# A worker killed without a clean shutdown never removes itself from the live set.
_FORGET_WORKER_AFTER_S = 86400
# Most jobs one retention sweep removes and most records it reads per round trip: a
# backlog (a TTL just switched on) drains over several sweeps instead of one long one.
MAX_EXPIRED_PER_SWEEP = 100
_PAGE = 200
# Each call retried on a dropped or refused connection for about 15 s (backoff from
# 50 ms, doubling, at most 1 s): a Redis restart or failover takes seconds, and failing
# a merge (or a split job's part) for it would turn a restart into re-runs. An outage
# longer than that fails the call as before; leases then decide who goes on. OSError:
# redis-py retries a refused connect only on the errors named here, and it raises the
# socket's own error (ConnectionRefusedError) there, not its ConnectionError.
OUTAGE_RETRY = Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=20,
                     supported_errors=(redis.ConnectionError, redis.TimeoutError, OSError))


class WorkerJobStore:
    def __init__(self, client: redis.Redis) -> None:
        self._r = client
        self._scripts = {s.name: client.register_script(s.lua) for s in scripts.ALL}

    @classmethod
    def from_url(cls, url: str, *, outage_retry: bool = True) -> WorkerJobStore:
        """A store whose calls wait out a Redis restart (``OUTAGE_RETRY``) instead of
        failing the work in hand: the job store persists (AOF), so once it is back every
        lease, part and record is as it was. ``outage_retry`` False: redis-py's few quick
        retries only, for a call that must not hold up what follows (a shutdown)."""
        if not outage_retry:
            return cls(redis.Redis.from_url(url, health_check_interval=30))
        return cls(redis.Redis.from_url(url, health_check_interval=30, retry=OUTAGE_RETRY))

    def close(self) -> None:
        self._r.close()

    def parts(self) -> PartStore:
        """The split merges' parts, on the same Redis (app.jobs.parts)."""
        return PartStore(self._r)

    def _run(self, call: Call[T]) -> T:
        return call.parse(self._scripts[call.script.name](keys=call.keys, args=call.args))

    def get(self, job_id: str) -> JobRecord | None:
        return decode(cast(dict[bytes, bytes], self._r.hgetall(job_key(job_id))))

    def claim(
        self, job_id: str, *, worker: str, lease_s: float, max_attempts: int,
        time_limit_s: float = float("inf"), pool: str | None = None,
    ) -> Claim:
        return self._run(calls.claim(job_id, worker=worker, lease_s=lease_s,
                                     max_attempts=max_attempts, time_limit_s=time_limit_s,
                                     pool=pool))

    def take(self, pools: list[str], *, worker: str, pool: str, lease_s: float,
             max_attempts: int, policy: str, weights: Mapping[str, float]) -> Taken:
        """Choose and claim the next job of ``pools`` (the fair-share scheduler's pick),
        atomically; see :data:`app.jobs.scripts.TAKE`."""
        return self._run(calls.take(pools, worker=worker, pool=pool, lease_s=lease_s,
                                    max_attempts=max_attempts, policy=policy,
                                    weights=weights))

    def pending(self, pool: str) -> int:
        """Jobs waiting in ``pool``'s fair-share queue."""
        owners = [text(o) for o in cast(set[bytes], self._r.smembers(sched_owners_key(pool)))]
        if not owners:
            return 0
        pipe = self._r.pipeline(transaction=False)
        for o in owners:
            pipe.zcard(sched_queue_key(pool, o))
        return sum(int(n) for n in pipe.execute())

    def messages_waiting(self, queue: str) -> int:
        """Messages in a Celery queue not yet delivered (the Redis transport's list)."""
        return int(cast(int, self._r.llen(queue)))

    def try_topup_lock(self, pool: str, seconds: float) -> bool:
        return bool(self._r.set(sched_topup_key(pool), "1", nx=True,
                                px=max(1, int(seconds * 1000))))

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

    def heartbeat(self, worker: str, pool: str | None = None) -> None:
        now = time.time()
        pipe = self._r.pipeline(transaction=False)
        for key in (WORKERS_KEY, *([sched_workers_key(pool)] if pool else [])):
            pipe.zadd(key, {worker: now})
            pipe.zremrangebyscore(key, "-inf", now - _FORGET_WORKER_AFTER_S)
        pipe.execute()

    def forget_worker(self, worker: str, pool: str | None = None) -> None:
        self._r.zrem(WORKERS_KEY, worker)
        self._r.hdel(SCHED_HOLDS_KEY, worker)
        if pool:
            self._r.zrem(sched_workers_key(pool), worker)

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
        leaves half-published files behind. Only prefixes no reader can reach belong
        here: failed attempts' own, and those of deleted or expired jobs (whose record,
        the only way to their files, went in the same script that added them).
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

    # -- retention: quota reservations, expiry, artifact collection ----------------------

    def reserve(self, rec: JobRecord, attempt: int, nbytes: int, *, quota: int | None,
                artifacts: tuple[str, ...] = ()) -> tuple[ReserveOutcome, int]:
        """Count ``nbytes`` of outputs against ``rec.owner``'s quota and reference
        ``artifacts``, before publishing; ``over`` leaves everything as it was."""
        return self._run(calls.reserve(rec.id, rec.owner, attempt, nbytes, quota=quota,
                                       artifacts=artifacts))

    def release(self, rec: JobRecord, attempt: int) -> None:
        """Give back what :meth:`reserve` took (the attempt ends without publishing)."""
        self._run(calls.reserve(rec.id, rec.owner, attempt, 0, quota=None))

    def touch_artifact(self, key: str) -> None:
        """An artifact was stored or used: an unreferenced one gets a new grace period.
        Best effort: the artifact is usable whether or not this is recorded."""
        try:
            self._run(calls.touch_artifact(key))
        except redis.RedisError as exc:
            log.warning("cannot record use of artifact %s: %s", key[:12], exc)

    def try_retention_lock(self, seconds: float) -> bool:
        """True for the one worker that runs the retention sweep in this period."""
        return bool(self._r.set(RETENTION_LOCK_KEY, "1", nx=True,
                                px=max(1, int(seconds * 1000))))

    def delete_outputs(self, storage: Storage, prefix: str) -> bool:
        """Delete a removed job's ``prefix`` now; if the store refuses, it stays with the
        orphans and the heartbeat retries. True when deleted."""
        try:
            storage.delete_prefix(prefix)
        except StorageError as exc:
            log.warning("outputs %s not deleted yet (retried later): %s", prefix, exc.message)
            return False
        self._r.srem(ORPHANS_KEY, prefix)
        return True

    def remove(self, rec: JobRecord, *, expire_before: float | None = None
               ) -> tuple[RemoveOutcome, int]:
        return self._run(calls.remove(rec, expire_before=expire_before))

    def _finished_before(self, status: str, cutoff_ms: int, offset: int
                         ) -> list[JobRecord | None]:
        """One page of the jobs that reached ``status`` before ``cutoff_ms`` (None for an
        entry whose record is gone)."""
        ids = [text(i) for i in cast(list[bytes], self._r.zrangebyscore(
            status_key(status), "-inf", cutoff_ms, start=offset, num=_PAGE))]
        if not ids:
            return []
        pipe = self._r.pipeline(transaction=False)
        for i in ids:
            pipe.hgetall(job_key(i))
        return [decode(raw) for raw in pipe.execute()]

    def expire_jobs(self, storage: Storage, *, older_than_s: float) -> list[str]:
        """Remove finished, unpinned jobs that ended more than ``older_than_s`` ago: their
        outputs, then (already done atomically with queueing those) their records."""
        cutoff = time.time() - older_than_s
        removed: list[str] = []
        for status in sorted(TERMINAL):
            offset = 0
            while len(removed) < MAX_EXPIRED_PER_SWEEP:
                page = self._finished_before(status, int(cutoff * 1000), offset)
                if not page:
                    break
                for rec in page:
                    outcome, _ = (("missing", 0) if rec is None else ("pinned", 0)
                                  if rec.pinned else self.remove(rec, expire_before=cutoff))
                    if outcome != "removed" or rec is None:
                        offset += 1  # still in the set: the next page starts after it
                        continue
                    removed.append(rec.id)
                    self.delete_outputs(storage, calls.job_storage_prefix(rec.id))
                    log.info("job %s expired (%s %s)", rec.id, rec.status, rec.finished_at)
        return removed

    def collect_artifacts(self, delete: Callable[[str], None], *, grace_s: float,
                          limit: int = 100) -> list[str]:
        """Delete (with ``delete(key)``) artifacts no job has referenced for ``grace_s``.

        A deletion the store refuses puts the artifact back as a candidate, with its old
        time, so the next sweep tries again."""
        cutoff = time.time() - grace_s
        due = cast(list[tuple[bytes, float]], self._r.zrangebyscore(
            UNREFERENCED_KEY, "-inf", int(cutoff * 1000), start=0, num=limit,
            withscores=True))
        collected: list[str] = []
        for raw, since in due:
            key = text(raw)
            if not self._run(calls.collect_artifact(key, unreferenced_before=cutoff)):
                continue
            try:
                delete(key)
            except StorageError as exc:
                log.warning("artifact %s not collected yet: %s", key[:12], exc.message)
                self._r.zadd(UNREFERENCED_KEY, {key: since}, nx=True)
                break
            collected.append(key)
            log.info("artifact %s collected (unreferenced)", key[:12])
        return collected
