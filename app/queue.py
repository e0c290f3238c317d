"""Enqueue work by task name, so the API never imports the worker (or torch).

Two kinds of merge message, neither carrying anything the record does not hold, which
is what makes a redelivered or duplicated message harmless:

- ``maec.take_next(pool)`` on the pool's queue: "a worker that can serve this pool is
  free: take the next job". Which job is the scheduler's choice, made atomically with
  the claim in Redis (app/jobs/scripts.py, TAKE): fair share between keys, priority.
  One is sent per submitted job; a spare one finds nothing and ends.
- ``maec.run_job(job_id)``: run that job (a job whose worker died, re-enqueued by the
  lease sweep on the pool that ran it). The claim decides whether anything is left to do.
"""

from __future__ import annotations

from celery import Celery

TASK_NAME = "maec.run_job"
TAKE_TASK_NAME = "maec.take_next"
# ``maec.run_part(job_id)`` on the pool's queue: help run a split job's parts.
PART_TASK_NAME = "maec.run_part"
# The default pool's queue (MAEC_POOLS' default, one pool without limits).
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


def send_take(celery: Celery, pool: str, *, retry: bool = True) -> None:
    """Wake one worker able to serve ``pool``."""
    celery.send_task(TAKE_TASK_NAME, args=[pool], queue=pool, retry=retry)


def send_part(celery: Celery, pool: str, job_id: str) -> None:
    """Ask one more worker of ``pool`` to run parts of split job ``job_id``."""
    celery.send_task(PART_TASK_NAME, args=[job_id], queue=pool)


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

    def enqueue(self, job_id: str, queue: str = QUEUE) -> None:
        """A message naming ``job_id`` (what a redelivery looks like)."""
        self.celery.send_task(TASK_NAME, args=[job_id], queue=queue, retry=False)

    def wake(self, pool: str) -> None:
        """A job entered ``pool``'s queue: wake a worker to take the next one."""
        send_take(self.celery, pool, retry=False)

    def enqueue_webhook(self, job_id: str) -> None:
        send_webhook(self.celery, job_id, retry=False)

    def close(self) -> None:
        self.celery.close()
