"""The Celery task: deliberately thin; all the work is in ``worker.runner``."""

from __future__ import annotations

import importlib
import logging

from celery import shared_task

# Imported here, in the prefork parent, so every child forks with torch already loaded
# (a merge child then starts in milliseconds). Importing torch does not initialise CUDA.
import maec_core.service.running  # noqa: F401
from app.jobs.worker_store import WorkerJobStore
from app.queue import TAKE_TASK_NAME, TASK_NAME, WEBHOOK_TASK_NAME, send_take, send_webhook
from app.settings import get_settings
from app.storage import make_storage
from app.webhooks.delivery import SOFT_TIME_LIMIT_S, TIME_LIMIT_S, deliver
from worker import dispatch
from worker.runner import JobRunner

log = logging.getLogger("maec.worker")

for _module in get_settings().preload_modules:
    importlib.import_module(_module)


def _runner() -> JobRunner:
    settings = get_settings()
    return JobRunner(settings, WorkerJobStore.from_url(settings.redis_url),
                     make_storage(settings),
                     on_finished=lambda ended: send_webhook(run_job.app, ended))


@shared_task(name=TASK_NAME, acks_late=True, ignore_result=True)  # type: ignore[untyped-decorator]
def run_job(job_id: str) -> str:
    return _runner().run(job_id)


@shared_task(name=TAKE_TASK_NAME, acks_late=True, ignore_result=True)  # type: ignore[untyped-decorator]
def take_next(pool: str) -> str:
    """A wake-up for ``pool``: run whichever job the scheduler hands this worker."""
    return dispatch.take_next(_runner(), pool,
                              wake=lambda other: send_take(take_next.app, other))


# Short limits of its own: one delivery attempt is a few network round trips; a later
# attempt is a new message, queued with its backoff as the countdown.
@shared_task(name=WEBHOOK_TASK_NAME, acks_late=True, ignore_result=True,  # type: ignore[untyped-decorator]
             time_limit=TIME_LIMIT_S, soft_time_limit=SOFT_TIME_LIMIT_S)
def deliver_webhook(job_id: str, attempt: int = 1) -> str:
    settings = get_settings()
    store = WorkerJobStore.from_url(settings.redis_url)
    try:
        return deliver(store, settings, job_id, attempt, lambda delay: send_webhook(
            deliver_webhook.app, job_id, attempt + 1, delay))
    finally:
        store.close()
