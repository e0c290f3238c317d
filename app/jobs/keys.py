"""Every Redis key the job store uses, named here and nowhere else.

The Lua scripts receive their keys as KEYS, except the few a script derives from a
record's fields (an owner's active set, a pool's scheduler keys): for those the scripts
get the prefixes as arguments and build the rest with :data:`LUA_KEYS`, generated here
from the same pieces as the Python builders. Renaming or re-prefixing a key is a change
to this module only.

Variable parts are encoded, never spliced in: every part that comes from outside the
code (an owner's key id, a pool name, a client address) is written as
:func:`part`, its length in UTF-8 bytes, ``:``, then the value (``alice`` is
``5:alice``), and a caller's idempotency key as the hex sha256 of its UTF-8 bytes. Each
key family is a fixed prefix followed by such parts, so the encoding is injective: two
different (owner, idempotency key) or (pool, owner) pairs can never name the same key,
whatever characters the values hold (key ids ``alice`` + ``ci:X`` and ``alice:ci`` + ``X``
used to share one slot when parts were joined with ``:``). Key ids are also restricted
to a small alphabet (``app.settings.KEY_ID_PATTERN``); the encoding does not rely on it.
"""

from __future__ import annotations

import hashlib

from app.jobs.record import STATUSES

PREFIX = "maec:"


def part(value: str) -> str:
    """One variable part of a key: its length in UTF-8 bytes, ``:``, the value.

    A reader that knows where a part starts knows where it ends, so no value (however
    many ``:`` it holds) can pass for another split of the same text. Lua's ``#s`` is the
    same byte count (:data:`LUA_KEYS`)."""
    return f"{len(value.encode())}:{value}"


def digest(value: str) -> str:
    """A caller-chosen string as a fixed-length part: its hex sha256 (64 characters)."""
    return hashlib.sha256(value.encode()).hexdigest()


# An owner's active set is ACTIVE_PREFIX + part(owner); scripts that end a job read the
# owner from the record and build this key themselves (LUA_KEYS).
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
# SCHED_PREFIX, which the scripts that build keys from a record's pool and owner get
# (<pool> and <owner> are part()s):
#   q:<pool>:<owner>   sorted set of the owner's queued jobs in the pool, scored
#                      band * BAND_SPAN + sequence (high priority first, then oldest)
#   owners:<pool>      set of the owners with queued jobs in the pool (members: key ids)
#   done:<pool>        list of the durations (s) of the pool's recent jobs, newest first
#   workers:<pool>     sorted set of the pool's live workers by heartbeat time
SCHED_PREFIX = f"{PREFIX}sched:"
_SCHED_QUEUE = "q:"
_SCHED_OWNERS = "owners:"
_SCHED_DONE = "done:"
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
    return f"{PREFIX}owner:{part(owner)}"


def active_key(owner: str) -> str:
    return ACTIVE_PREFIX + part(owner)


def status_key(status: str) -> str:
    return f"{PREFIX}status:{status}"


def idem_key(owner: str, key: str) -> str:
    """The job an owner's idempotency key names: the owner as a part, the key hashed."""
    return f"{PREFIX}idem:{part(owner)}:{digest(key)}"


def usage_key(owner: str) -> str:
    """Bytes of published outputs that ``owner``'s existing jobs hold (storage quota)."""
    return f"{PREFIX}usage:{part(owner)}"


def refs_key(artifact: str) -> str:
    return REFS_PREFIX + artifact


def requeue_key(job_id: str) -> str:
    """Short-lived marker: one live worker re-enqueues an expired job, not all of them."""
    return f"{PREFIX}requeue:{job_id}"


STATUS_KEYS: tuple[str, ...] = tuple(status_key(s) for s in STATUSES)


def sched_queue_key(pool: str, owner: str) -> str:
    return f"{SCHED_PREFIX}{_SCHED_QUEUE}{part(pool)}:{part(owner)}"


def sched_owners_key(pool: str) -> str:
    return f"{SCHED_PREFIX}{_SCHED_OWNERS}{part(pool)}"


def sched_done_key(pool: str) -> str:
    return f"{SCHED_PREFIX}{_SCHED_DONE}{part(pool)}"


def sched_workers_key(pool: str) -> str:
    return f"{SCHED_PREFIX}workers:{part(pool)}"


def sched_topup_key(pool: str) -> str:
    """Held for one heartbeat by the worker checking the pool's wake-up messages."""
    return f"{SCHED_PREFIX}topup:{part(pool)}"


# The builders above that scripts need, in Lua, for scripts that get the prefixes as
# ``A.active_prefix`` and ``A.sched_prefix`` (app.jobs.scripts prepends this to them).
# ``#s`` is the string's length in bytes, as part() counts; tests/api/test_job_store.py
# checks each against its Python twin on awkward values.
LUA_KEYS = f"""
local function part(s) return #s .. ':' .. s end
local function active_key(owner) return A.active_prefix .. part(owner) end
local function sched_queue_key(pool, owner)
  return A.sched_prefix .. '{_SCHED_QUEUE}' .. part(pool) .. ':' .. part(owner)
end
local function sched_owners_key(pool) return A.sched_prefix .. '{_SCHED_OWNERS}' .. part(pool) end
local function sched_done_key(pool) return A.sched_prefix .. '{_SCHED_DONE}' .. part(pool) end
"""
