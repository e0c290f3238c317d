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
from app.queue import QUEUE, TASK_NAME
from app.settings import Settings
from app.storage.base import Storage

log = logging.getLogger("maec.worker")
DAY_S = 86400.0


def sweep_expired(store: WorkerJobStore, celery: Celery, settings: Settings) -> list[str]:
    """Every job re-enqueued by this sweep."""

    def requeue(job_id: str) -> None:
        celery.send_task(TASK_NAME, args=[job_id], queue=QUEUE)

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
