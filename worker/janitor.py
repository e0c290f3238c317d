"""Staging objects a failed attempt could not delete, removed once the store is back.

When publishing fails because the object store is unreachable, the attempt's cleanup
fails for the same reason. Its staging prefix is then remembered in a Redis set, and
every worker's heartbeat retries the deletion until the store answers, so an outage
never leaves half-published files behind. Only failed attempts' own prefixes
(``jobs/<id>/a<n>/``) are ever added: nothing a reader could trust (no manifest of a
succeeded job) lives under them.
"""

from __future__ import annotations

import logging
from typing import cast

import redis

from app.jobs.record import PREFIX
from app.storage.base import Storage, StorageError

log = logging.getLogger("maec.worker.janitor")
ORPHANS_KEY = f"{PREFIX}orphans"


def remember_orphan(r: redis.Redis, prefix: str) -> None:
    """Record ``prefix`` for a later deletion (best effort: Redis may be down too)."""
    try:
        r.sadd(ORPHANS_KEY, prefix)
    except redis.RedisError as exc:
        log.error("cannot record orphaned staging prefix %s: %s", prefix, exc)


def clean_orphans(r: redis.Redis, storage: Storage) -> list[str]:
    """Delete every remembered prefix the store now accepts; returns those removed."""
    removed: list[str] = []
    for raw in cast(set[bytes], r.smembers(ORPHANS_KEY)):
        prefix = raw.decode()
        try:
            storage.delete_prefix(prefix)
        except StorageError as exc:
            log.info("staging %s still not deletable: %s", prefix, exc.message)
            break  # the store is still down; the next heartbeat tries again
        r.srem(ORPHANS_KEY, prefix)
        removed.append(prefix)
        log.info("removed orphaned staging %s", prefix)
    return removed
