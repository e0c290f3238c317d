"""The worker heartbeat's sweeps, bound to the worker's Celery app and settings.

- Expired leases: running jobs whose worker died are re-enqueued. Finding them and
  deciding which worker enqueues each is the job store's
  (:meth:`app.jobs.worker_store.WorkerJobStore.sweep_expired`).
- Retention: finished, unpinned jobs older than ``MAEC_JOB_TTL_DAYS`` are removed with
  their outputs, and ability artifacts no job has referenced for
  ``MAEC_ARTIFACT_GRACE_SECONDS`` are deleted. One worker per
  ``MAEC_RETENTION_SWEEP_SECONDS`` does it (a lock in Redis), not every worker every beat.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from celery import Celery

from app.artifacts import StorageArtifactStore
from app.jobs.worker_store import WorkerJobStore
from app.queue import QUEUE, TASK_NAME, send_take
from app.scheduler.pools import served_by
from app.settings import Settings
from app.storage.base import Storage

log = logging.getLogger("maec.worker")
DAY_S = 86400.0


def sweep_expired(store: WorkerJobStore, celery: Celery, settings: Settings) -> list[str]:
    """Every job re-enqueued by this sweep (on the queue of the pool that ran it)."""

    def requeue(job_id: str) -> None:
        rec = store.get(job_id)
        pool = (rec.ran_pool or rec.pool) if rec is not None else None
        queue = pool if pool in settings.pools else QUEUE
        celery.send_task(TASK_NAME, args=[job_id], queue=queue)

    # The marker lasts one lease: other workers sweeping meanwhile skip the job.
    return store.sweep_expired(requeue, marker_ttl_s=max(2, settings.lease_seconds))


@dataclass
class Swept:
    """What one retention sweep removed (empty when another worker holds the period)."""

    jobs: list[str] = field(default_factory=list)
    artifacts: list[str] = field(default_factory=list)


def sweep_retention(store: WorkerJobStore, storage: Storage, settings: Settings) -> Swept:
    """Expire old jobs (when a TTL is set) and collect unreferenced artifacts."""
    out = Swept()
    if not store.try_retention_lock(settings.retention_sweep_seconds):
        return out
    if settings.job_ttl_days is not None:
        out.jobs = store.expire_jobs(storage, older_than_s=settings.job_ttl_days * DAY_S)
    artifacts = StorageArtifactStore(storage, settings.work_dir / "artifacts",
                                     settings.artifact_cache_max_bytes)
    out.artifacts = store.collect_artifacts(artifacts.delete,
                                            grace_s=settings.artifact_grace_seconds)
    if out.jobs or out.artifacts:
        log.info("retention: %d job(s) expired, %d artifact(s) collected",
                 len(out.jobs), len(out.artifacts))
    return out


# Most wake-ups one top-up sends for a pool (the next heartbeat sends more).
MAX_TOPUP = 100


def top_up_wakeups(store: WorkerJobStore, celery: Celery, settings: Settings
                   ) -> dict[str, int]:
    """Send a pool as many wake-up messages as it has queued jobs beyond the messages
    waiting; returns what was sent, by pool.

    One wake-up goes out per submitted job, so this sends nothing in the normal course.
    It repairs the rare loss of one (Redis restarted from an AOF a second behind the
    job's record, a broker hiccup between the record and its message): a job never
    waits for a message that will not come. A spare wake-up finds nothing and ends, so
    erring high costs a no-op task. One worker per pool per heartbeat does it.
    """
    sent: dict[str, int] = {}
    for pool in served_by(settings.own_pool, settings.pools):
        if not store.try_topup_lock(pool, settings.worker_heartbeat_seconds):
            continue
        missing = store.pending(pool) - store.messages_waiting(pool)
        for _ in range(min(MAX_TOPUP, max(0, missing))):
            send_take(celery, pool)
        if missing > 0:
            sent[pool] = min(MAX_TOPUP, missing)
            log.warning("pool %s: %d queued job(s) had no wake-up; sent", pool, missing)
    return sent
