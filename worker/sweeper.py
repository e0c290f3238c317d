"""Re-enqueue running jobs whose lease expired (their worker died).

Celery alone would redeliver an unacknowledged message only after the visibility
timeout (hours, since it must exceed the longest merge). The lease is the faster
signal; re-enqueueing is harmless because the claim decides, and a per-job ``SET NX``
marker keeps every live worker from enqueueing the same job at once.
"""

from __future__ import annotations

import logging
import time
from typing import Any, cast

from celery import Celery

from app.jobs.record import PREFIX, job_key, status_key
from app.jobs.worker_store import WorkerJobStore
from app.queue import QUEUE, TASK_NAME
from app.settings import Settings

log = logging.getLogger("maec.worker.sweeper")


def expired_jobs(store: WorkerJobStore, now: float) -> list[str]:
    out: list[str] = []
    for status in ("running", "publishing"):
        ids = [i.decode() for i in cast(list[bytes], store.r.zrange(status_key(status), 0, -1))]
        if not ids:
            continue
        pipe = store.r.pipeline(transaction=False)
        for i in ids:
            pipe.hget(job_key(i), "lease_until")
        leases: list[Any] = pipe.execute()
        out += [i for i, lease in zip(ids, leases, strict=True)
                if lease is not None and float(lease) < now]
    return out


def sweep_expired(store: WorkerJobStore, celery: Celery, settings: Settings) -> list[str]:
    requeued = []
    for job_id in expired_jobs(store, time.time()):
        marker = f"{PREFIX}requeue:{job_id}"
        if store.r.set(marker, "1", nx=True, ex=max(2, settings.lease_seconds)):
            celery.send_task(TASK_NAME, args=[job_id], queue=QUEUE)
            log.warning("job %s: lease expired, re-enqueued", job_id)
            requeued.append(job_id)
    return requeued
