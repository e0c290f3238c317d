"""Every Celery reliability setting, in one reviewed place.

Why each one:
- ``task_acks_late`` + ``task_reject_on_worker_lost``: a message is acknowledged only
  after the task returns, and a killed child puts it back; the job record (not the
  queue) decides whether the redelivery has anything left to do.
- ``worker_prefetch_multiplier = 1``: a worker holds one merge at a time, so a second
  message is not stuck behind an hours-long merge on a busy worker.
- ``worker_max_tasks_per_child = 1``: a merge's memory (pinned buffers, allocator
  caches, CUDA context) dies with its child process.
- ``visibility_timeout`` above the hard time limit, in the broker *and* the result
  transport options: Redis re-delivers an unacknowledged message after this long, and a
  timeout shorter than a merge would start a duplicate of every long job.
- JSON only: no pickle ever crosses the broker.
- Soft time limit a minute under the hard one, so the task can mark its job
  ``time_limit`` and clean up before the hard kill.
- Webhook deliveries (``maec.deliver_webhook``) go to their own queue with their own
  short time limits (set on the task): every worker also consumes it between merges
  (worker/celery_app.py), so a delivery never waits behind queued merges, and a receiver
  that is down never holds a merge slot (each retry is a new message with a countdown).
- Attempts are bounded by the record (``MAEC_MAX_ATTEMPTS``, counted by the claim), not
  by Celery retries, so a poison job fails instead of looping.
"""

from __future__ import annotations

from typing import Any

from app.queue import QUEUE, TASK_NAME, WEBHOOK_QUEUE, WEBHOOK_TASK_NAME
from app.settings import Settings

# Margin of the visibility timeout over the hard time limit.
VISIBILITY_MARGIN_S = 600


def celery_settings(s: Settings) -> dict[str, Any]:
    hard = s.task_time_limit
    transport = {"visibility_timeout": hard + VISIBILITY_MARGIN_S}
    return {
        "broker_url": s.redis_url,
        "result_backend": s.redis_url,
        "broker_transport_options": dict(transport),
        "result_backend_transport_options": dict(transport),
        "broker_connection_retry_on_startup": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "task_ignore_result": True,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "worker_prefetch_multiplier": 1,
        "worker_max_tasks_per_child": 1,
        "worker_concurrency": 1,
        "worker_pool": "worker.pool:TaskPool",
        "task_time_limit": hard,
        "task_soft_time_limit": max(1, hard - 60) if hard > 120 else max(1, hard - 5),
        "task_default_queue": QUEUE,
        "task_routes": {TASK_NAME: {"queue": QUEUE},
                        WEBHOOK_TASK_NAME: {"queue": WEBHOOK_QUEUE}},
        "worker_hijack_root_logger": False,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
    }
