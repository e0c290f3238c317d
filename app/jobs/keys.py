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

# The fair-share scheduler (docs/scheduling.md). Every name below starts with
# SCHED_PREFIX, which the scripts that build keys from a record's pool and owner get:
#   q:<pool>:<owner>   sorted set of the owner's queued jobs in the pool, scored
#                      band * BAND_SPAN + sequence (high priority first, then oldest)
#   owners:<pool>      set of the owners with queued jobs in the pool
#   done:<pool>        list of the durations (s) of the pool's recent jobs, newest first
#   workers:<pool>     sorted set of the pool's live workers by heartbeat time
SCHED_PREFIX = f"{PREFIX}sched:"
SCHED_SEQ_KEY = f"{SCHED_PREFIX}seq"
# owner -> service received (cost / weight of the jobs taken): ties between owners with
# equal running work go to the one served least.
SCHED_SERVED_KEY = f"{SCHED_PREFIX}served"
# worker -> id of the job it took last. A worker is held by its job until it takes the
# next one: the turnaround between jobs (the Celery ack, a fresh merge child, the next
# message) counts against the job's owner as running work, for at most HOLD_MS after the
# job ended (a worker that died or drained releases its hold then).
SCHED_HOLDS_KEY = f"{SCHED_PREFIX}holds"
HOLD_MS = 10_000
# Sequence numbers stay below this; a job's score is band * BAND_SPAN + sequence.
BAND_SPAN = 10**12
# Jobs of the pool's recent past whose durations feed the queue's ETA.
RECENT_DONE = 50


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


def sched_queue_key(pool: str, owner: str) -> str:
    return f"{SCHED_PREFIX}q:{pool}:{owner}"


def sched_owners_key(pool: str) -> str:
    return f"{SCHED_PREFIX}owners:{pool}"


def sched_done_key(pool: str) -> str:
    return f"{SCHED_PREFIX}done:{pool}"


def sched_workers_key(pool: str) -> str:
    return f"{SCHED_PREFIX}workers:{pool}"


def sched_topup_key(pool: str) -> str:
    """Held for one heartbeat by the worker checking the pool's wake-up messages."""
    return f"{SCHED_PREFIX}topup:{pool}"
