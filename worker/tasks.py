"""The Celery task: deliberately thin; all the work is in ``worker.runner``."""

from __future__ import annotations

import importlib
import logging

from celery import shared_task

# Imported here, in the prefork parent, so every child forks with torch already loaded
# (a merge child then starts in milliseconds). Importing torch does not initialise CUDA.
import maec_core.run  # noqa: F401
from app.jobs.worker_store import WorkerJobStore
from app.queue import TASK_NAME
from app.settings import get_settings
from app.storage import make_storage
from worker.runner import JobRunner

log = logging.getLogger("maec.worker")

for _module in get_settings().preload_modules:
    importlib.import_module(_module)


@shared_task(name=TASK_NAME, acks_late=True, ignore_result=True)  # type: ignore[untyped-decorator]
def run_job(job_id: str) -> str:
    settings = get_settings()
    runner = JobRunner(settings, WorkerJobStore.from_url(settings.redis_url),
                       make_storage(settings))
    return runner.run(job_id)
