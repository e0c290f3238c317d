"""A free worker takes the next job the fair-share scheduler picks for it.

A wake-up message (``maec.take_next(pool)``, app/queue.py) says only "a worker that can
serve ``pool`` is free". The worker offers the scheduler that pool first, then its own
pool, then every pool it covers, largest first; the scheduler's script chooses the job
(priority band, fair share between keys across all of those pools, then the first pool
in that order, then age) and claims it in the same atomic call, and the runner goes on
from that claim. When the job came from another pool than the message's, the message's
pool gets a new wake-up at once, so every queued job keeps a message waiting for it. A
message that finds nothing (a spare: a duplicate, or one topped up by the heartbeat)
ends there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from app.jobs.calls import Claim, ClaimOutcome
from app.scheduler.pools import served_by
from worker.runner import JobRunner

log = logging.getLogger("maec.worker")


def queues_to_look_in(token_pool: str, runner: JobRunner) -> list[str]:
    served = served_by(runner.settings.own_pool, runner.settings.pools)
    first = [token_pool] if token_pool in served else []
    return list(dict.fromkeys([*first, *served]))


def take_next(runner: JobRunner, token_pool: str,
              wake: Callable[[str], None] | None = None) -> str:
    """Take and run the scheduler's next job for this worker; the outcome. ``wake``
    sends a pool a wake-up (replacing this message when the job came from elsewhere)."""
    s = runner.settings
    taken = runner.store.take(queues_to_look_in(token_pool, runner), worker=runner.worker,
                              pool=s.own_pool, lease_s=s.lease_seconds,
                              max_attempts=s.max_attempts, policy=s.scheduler_policy,
                              weights=s.key_weights)
    if taken.outcome == "empty":
        log.info("pool %s: nothing to take", token_pool)
        return "empty"
    log.info("job %s: taken from the %s queue (attempt %d)", taken.job_id,
             taken.pool or token_pool, taken.attempt)
    if wake is not None and taken.pool and taken.pool != token_pool:
        # This message was the one sent for a job of token_pool; that job still waits.
        wake(token_pool)
    outcome: ClaimOutcome = "claimed" if taken.outcome == "claimed" else "exhausted"
    return runner.run_claimed(taken.job_id, Claim(outcome, taken.attempt))
