"""Every Redis key the job store uses, named here and nowhere else.

The Lua scripts receive their keys as KEYS (and, for the one key a script derives from a
record's field, the owner's active set, its prefix as an argument), so renaming or
re-prefixing a key is a change to this module only.
"""

from __future__ import annotations

from app.jobs.record import STATUSES

PREFIX = "maec:"
# An owner's active set is ACTIVE_PREFIX + owner; scripts that end a job read the owner
# from the record and build this key themselves.
ACTIVE_PREFIX = f"{PREFIX}active:"

METRICS_KEY = f"{PREFIX}metrics"
WORKERS_KEY = f"{PREFIX}workers"
# Staging prefixes a failed attempt could not delete (the object store was down).
ORPHANS_KEY = f"{PREFIX}orphans"
# Artifacts no job references, scored by the epoch ms they were last stored, fetched or
# released: collected once that is older than the grace period.
UNREFERENCED_KEY = f"{PREFIX}artifacts:unreferenced"
# The jobs referencing one artifact are the set REFS_PREFIX + artifact key; scripts build
# it from the keys listed in a record (like the active set from the owner).
REFS_PREFIX = f"{PREFIX}artifact-refs:"
# Held by the one worker running the retention sweep (expiry, artifact collection).
RETENTION_LOCK_KEY = f"{PREFIX}retention-lock"


def job_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}"


def owner_key(owner: str) -> str:
    """Every job of one owner (a sorted set read lexicographically, newest first)."""
    return f"{PREFIX}owner:{owner}"


def active_key(owner: str) -> str:
    return ACTIVE_PREFIX + owner


def status_key(status: str) -> str:
    return f"{PREFIX}status:{status}"


def idem_key(owner: str, key: str) -> str:
    return f"{PREFIX}idem:{owner}:{key}"



def usage_key(owner: str) -> str:
    """Bytes of published outputs that ``owner``'s existing jobs hold (storage quota)."""
    return f"{PREFIX}usage:{owner}"


def refs_key(artifact: str) -> str:
    return REFS_PREFIX + artifact


def requeue_key(job_id: str) -> str:
    """Short-lived marker: one live worker re-enqueues an expired job, not all of them."""
    return f"{PREFIX}requeue:{job_id}"


STATUS_KEYS: tuple[str, ...] = tuple(status_key(s) for s in STATUSES)
