"""Enqueue jobs by task name, so the API never imports the worker (or torch).

The message carries only the job id: the record in Redis holds everything else, which
is what makes a redelivered or duplicated message harmless.
"""

from __future__ import annotations

from celery import Celery

TASK_NAME = "maec.run_job"
QUEUE = "merges"
# A finished job's signed webhook (app/webhooks/delivery.py), one attempt per message.
# Its own queue, so a delivery never waits behind queued merges: every worker also takes
# it between merges (worker/celery_app.py), and a small worker may serve it alone.
WEBHOOK_TASK_NAME = "maec.deliver_webhook"
WEBHOOK_QUEUE = "webhooks"


def send_webhook(celery: Celery, job_id: str, attempt: int = 1, delay_s: float = 0.0,
                 *, retry: bool = True) -> None:
    """Queue attempt ``attempt`` of ``job_id``'s webhook, due in ``delay_s`` seconds."""
    celery.send_task(WEBHOOK_TASK_NAME, args=[job_id, attempt], queue=WEBHOOK_QUEUE,
                     countdown=delay_s if delay_s > 0 else None, retry=retry)


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

    def enqueue_webhook(self, job_id: str) -> None:
        send_webhook(self.celery, job_id, retry=False)

    def close(self) -> None:
        self.celery.close()
