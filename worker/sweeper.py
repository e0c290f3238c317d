"""Re-enqueue running jobs whose lease expired (their worker died), through Celery.

Finding them and deciding which worker enqueues each is the job store's
(:meth:`app.jobs.worker_store.WorkerJobStore.sweep_expired`); this binds it to the
worker's Celery app and the lease setting.
"""

from __future__ import annotations

from celery import Celery

from app.jobs.worker_store import WorkerJobStore
from app.queue import QUEUE, TASK_NAME
from app.settings import Settings


def sweep_expired(store: WorkerJobStore, celery: Celery, settings: Settings) -> list[str]:
    """Every job re-enqueued by this sweep."""

    def requeue(job_id: str) -> None:
        celery.send_task(TASK_NAME, args=[job_id], queue=QUEUE)

    # The marker lasts one lease: other workers sweeping meanwhile skip the job.
    return store.sweep_expired(requeue, marker_ttl_s=max(2, settings.lease_seconds))
