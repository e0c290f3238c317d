"""Enqueue jobs by task name, so the API never imports the worker (or torch).

The message carries only the job id: the record in Redis holds everything else, which
is what makes a redelivered or duplicated message harmless.
"""

from __future__ import annotations

from celery import Celery

TASK_NAME = "maec.run_job"
QUEUE = "merges"


class Enqueuer:
    def __init__(self, broker_url: str) -> None:
        self.celery = Celery("maec-api", broker=broker_url, set_as_current=False)
        self.celery.conf.update(
            task_serializer="json",
            accept_content=["json"],
            broker_connection_retry_on_startup=True,
            # Fail a submission fast (503) instead of hanging when Redis is down.
            broker_transport_options={"max_retries": 2, "interval_start": 0,
                                      "interval_step": 0.2, "interval_max": 0.5},
        )

    def enqueue(self, job_id: str) -> None:
        self.celery.send_task(TASK_NAME, args=[job_id], queue=QUEUE, retry=False)

    def close(self) -> None:
        self.celery.close()
