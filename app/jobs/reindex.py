"""Rebuild every per-owner index of the job store from the job records.

The records are the truth (docs/architecture.md); the owner's job list, active set,
fair-share queue, idempotency entries and storage usage are derived from them. When the
names of those keys change (``app.jobs.keys``: owner ids are now length-prefixed parts,
idempotency keys hashed), a store written under the old names still holds every record,
and this rebuilds the indexes under the current names:

    python -m app.jobs.reindex        # MAEC_REDIS_URL, with the API and workers stopped

Safe to run again (every write is the same for the same records). Run it with the
service stopped: a job that changes state meanwhile could be indexed as it was. Keys
under the old names are left in place, unread.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import cast

import redis

from app.jobs.calls import band
from app.jobs.keys import (
    BAND_SPAN,
    active_key,
    idem_key,
    job_key,
    owner_key,
    sched_owners_key,
    sched_queue_key,
    usage_key,
)
from app.jobs.record import ACTIVE, decode
from app.settings import SettingsInvalid, get_settings


def rebuild(r: redis.Redis) -> dict[str, int]:
    """Index every record under the current key names; counts of what was written."""
    counts: Counter[str] = Counter()
    usage: Counter[str] = Counter()
    for name in r.scan_iter(match=job_key("*"), count=500):
        rec = decode(cast(dict[bytes, bytes], r.hgetall(name)))
        if rec is None:
            continue
        counts["jobs"] += 1
        pipe = r.pipeline(transaction=True)
        pipe.zadd(owner_key(rec.owner), {rec.id: 0})
        if rec.status in ACTIVE:
            pipe.sadd(active_key(rec.owner), rec.id)
            counts["active"] += 1
        if rec.status == "queued" and rec.pool:
            pipe.zadd(sched_queue_key(rec.pool, rec.owner),
                      {rec.id: band(rec.priority) * BAND_SPAN + rec.seq})
            pipe.sadd(sched_owners_key(rec.pool), rec.owner)
            counts["queued"] += 1
        if rec.idempotency_key:
            # An entry already there (a later job under the new names) is kept.
            pipe.set(idem_key(rec.owner, rec.idempotency_key), rec.id, nx=True)
            counts["idempotency_keys"] += 1
        pipe.execute()
        usage[rec.owner] += rec.published_bytes
    for owner, used in usage.items():
        if used > 0:
            r.set(usage_key(owner), used)
        else:
            r.delete(usage_key(owner))
    counts["owners"] = len(usage)
    return dict(counts)


def main() -> int:
    try:
        url = get_settings().redis_url
    except SettingsInvalid as exc:
        print(f"reindex: {exc.message}", file=sys.stderr)
        return 2
    done = rebuild(redis.Redis.from_url(url))
    print("reindex: " + " ".join(f"{k}={v}" for k, v in sorted(done.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
