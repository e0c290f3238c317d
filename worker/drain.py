"""SIGTERM drains a worker: it takes no new job, the running one finishes, then it exits.

Celery's warm shutdown (its answer to SIGTERM on the main process, which is what
Kubernetes and ``docker stop`` send) stops consuming at once and waits for the running
task; with ``task_acks_late`` and a prefetch of one, the worker holds no other message,
and one it had reserved goes back to the broker when it disconnects. This module adds
what the service needs around that:

- the heartbeat stops announcing the worker as a live member of its pool (the queue's
  ETA and ``GET /v1/queue`` stop counting it) and stops topping up wake-ups;
- the log says what is happening and what happens if the drain is cut short.

If the grace period ends first (SIGKILL), the running job is not lost: its lease expires
within ``MAEC_LEASE_SECONDS`` and the lease sweep re-enqueues it on its pool for another
worker, whose claim is the next attempt (the record, not the message, decides; a second
copy of the work cannot publish over the first). Set the pod's termination grace above
the longest stage a job may be in when the signal comes (docs/scheduling.md).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
from typing import Any

from celery.signals import worker_shutting_down

from app.jobs.worker_store import WorkerJobStore
from app.settings import get_settings

log = logging.getLogger("maec.worker")
# Set in the main process (Celery's shutdown signal arrives there) and read in the pool
# children forked from it (a split job's helper asks between parts): one flag shared by
# fork, not a threading.Event of which each child would hold its own, never-set copy.
_draining = multiprocessing.get_context("fork").Event()


def draining() -> bool:
    return _draining.is_set()


def install_drain(name: str) -> None:
    """Connect the drain to Celery's shutdown signal for worker ``name``."""

    @worker_shutting_down.connect(weak=False)  # type: ignore[untyped-decorator]
    def _drain(sig: str = "", how: str = "", exitcode: int = 0, **_kw: Any) -> None:
        _draining.set()
        log.warning("worker %s: %s received, draining (%s): no new job is taken, the "
                    "running one finishes; killed before that, its lease expires and it "
                    "is re-queued", name, sig or "shutdown", how or "warm")
        settings = get_settings()
        with contextlib.suppress(Exception):  # Redis down: the entry ages out
            store = WorkerJobStore.from_url(settings.redis_url, outage_retry=False)
            try:
                store.forget_worker(name, settings.own_pool)
            finally:
                store.close()
