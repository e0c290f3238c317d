"""The Celery application: ``celery -A worker.celery_app worker -Q merges``.

Every worker also consumes the webhook queue (added below, whatever ``-Q`` names), so
finished jobs' webhooks go out without a worker of their own; a deployment may still
run one (``-Q webhooks -c 4``) so that deliveries never wait for a running merge.

The parent (prefork) process imports torch through ``worker.tasks`` so that each child
forks with it loaded, but never touches CUDA: device selection happens in the child,
inside the task. The parent runs the heartbeat thread: ``/readyz`` counts live workers,
each beat sweeps expired leases and retries deleting orphaned staging prefixes, and one
worker per period runs the retention sweep (expired jobs, unreferenced artifacts).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from typing import Any

from celery import Celery
from celery.signals import celeryd_after_setup, worker_ready, worker_shutdown

from app.jobs.worker_store import WorkerJobStore
from app.queue import WEBHOOK_QUEUE
from app.scheduler.pools import served_by
from app.settings import get_settings
from app.storage import make_storage
from worker.celery_config import celery_settings
from worker.drain import draining, install_drain
from worker.sweeper import sweep_expired, sweep_retention, top_up_wakeups

log = logging.getLogger("maec.worker")

celery = Celery("maec-worker")
celery.conf.update(celery_settings(get_settings()))
# Registers the task (by name) in this app.
celery.conf.imports = ("worker.tasks",)

_stop = threading.Event()
_NAME = f"{socket.gethostname()}:{os.getpid()}"


def _heartbeat() -> None:
    settings = get_settings()
    store = WorkerJobStore.from_url(settings.redis_url)
    storage = make_storage(settings)
    while True:
        try:
            store.heartbeat(_NAME, None if draining() else settings.own_pool)
            sweep_expired(store, celery, settings)
            if not draining():
                top_up_wakeups(store, celery, settings)
            store.clean_orphans(storage)
            sweep_retention(store, storage, settings)
        except Exception as exc:  # Redis down: keep trying, readyz shows it meanwhile
            log.warning("heartbeat failed: %s", exc)
        if _stop.wait(settings.worker_heartbeat_seconds):
            break
    with contextlib.suppress(Exception):
        store.forget_worker(_NAME, settings.own_pool)


@celeryd_after_setup.connect  # type: ignore[untyped-decorator]
def _consume_webhooks(sender: str, instance: Any, **_kw: Any) -> None:
    instance.app.amqp.queues.select_add(WEBHOOK_QUEUE)
    # The worker's pool's queue and those of the pools it covers, whatever -Q names.
    settings = get_settings()
    for pool in served_by(settings.own_pool, settings.pools):
        instance.app.amqp.queues.select_add(pool)


install_drain(_NAME)


@worker_ready.connect  # type: ignore[untyped-decorator]
def _start_heartbeat(**_kw: Any) -> None:
    threading.Thread(target=_heartbeat, name="maec-heartbeat", daemon=True).start()
    get_settings().warn_if_dev()
    log.info("worker %s ready", _NAME)


@worker_shutdown.connect  # type: ignore[untyped-decorator]
def _stop_heartbeat(**_kw: Any) -> None:
    _stop.set()
