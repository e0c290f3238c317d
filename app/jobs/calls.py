"""Every state change of a job as one packed script call and the reading of its reply.

Built here once and run by either face of the store (the worker's sync one, the API's
async one), so both sides agree on the arguments and outcomes by construction.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar, cast

from app.jobs import scripts
from app.jobs.keys import (
    HOLD_MS,
    METRICS_KEY,
    ORPHANS_KEY,
    REFS_PREFIX,
    SCHED_HOLDS_KEY,
    SCHED_SEQ_KEY,
    SCHED_SERVED_KEY,
    UNREFERENCED_KEY,
    active_key,
    idem_key,
    job_key,
    owner_key,
    requeue_key,
    sched_owners_key,
    sched_queue_key,
    status_key,
    usage_key,
)
from app.jobs.parts import parts_key
from app.jobs.record import JobRecord, encode, now_iso, storable_fields, text
from app.jobs.scripts import Arg, Script
from maec_core.service import MaecError

T = TypeVar("T")
CreateOutcome = Literal["created", "existing", "conflict", "too_many"]
CancelOutcome = Literal["cancelled", "requested", "finished", "missing"]
ReserveOutcome = Literal["ok", "over", "lost"]
RemoveOutcome = Literal["removed", "missing", "active", "pinned", "kept"]
ClaimOutcome = Literal["claimed", "busy", "done", "missing", "cancelled", "exhausted",
                       "time_limit"]
# Lua has no infinity literal and tonumber('inf') is nil: "no limit" is sent as this.
_NO_LIMIT = "1e300"


class QuotaExceeded(MaecError):
    """Publishing the job's outputs would take its key past its storage quota."""

    code = "quota_exceeded"


@dataclass(frozen=True)
class Call(Generic[T]):
    """One script invocation, its KEYS and ARGV packed, and how to read its reply."""

    script: Script
    keys: list[str]
    args: list[Arg]
    parse: Callable[[Any], T]


@dataclass(frozen=True)
class Claim:
    outcome: ClaimOutcome
    attempt: int


def _now_ms(now: float | None = None) -> int:
    return int((time.time() if now is None else now) * 1000)


def _pairs(fields: Mapping[str, Any]) -> list[Arg]:
    """Record fields as ARGV field, value, ... (values JSON, as the hash stores them)."""
    return [x for kv in encode(dict(fields)).items() for x in kv]


def create(record: JobRecord, *, max_active: int, weights: Mapping[str, float],
           credit: int) -> Call[tuple[CreateOutcome, str]]:
    """Store a new queued job unless its owner has ``max_active`` active jobs or its
    idempotency key names an earlier job of the same owner (``existing``, with that job's
    id; ``conflict``, with no id, when the job there is another owner's). ``credit``
    and ``weights``: where an owner new to the pool's queue starts in the fair share (one
    round behind the least served: ``credit`` jobs, the pool's live workers)."""
    owner = record.owner
    pool = record.pool or ""
    keys, args = scripts.CREATE.pack(
        {"job": job_key(record.id), "owner": owner_key(owner), "active": active_key(owner),
         "queued": status_key("queued"), "idem": idem_key(owner, record.idempotency_key or ""),
         "sched_queue": sched_queue_key(pool, owner), "sched_owners": sched_owners_key(pool),
         "seq": SCHED_SEQ_KEY, "served": SCHED_SERVED_KEY},
        {"id": record.id, "max_active": max_active,
         "has_idem": "1" if record.idempotency_key else "0", "now_ms": _now_ms(),
         "owner_name": owner, "owner_json": json.dumps(owner), "job_prefix": job_key(""),
         "band": band(record.priority) if pool else "",
         "credit": credit, "weights_json": json.dumps(dict(weights))},
        # Strictly serialised first: a record no reader could be sent is never stored.
        _pairs(storable_fields(record, exclude={"queue"})),
    )

    def parse(reply: list[Any]) -> tuple[CreateOutcome, str]:
        return cast(CreateOutcome, text(reply[0])), text(reply[1])

    return Call(scripts.CREATE, keys, args, parse)


def band(priority: str) -> int:
    """The priority's band in the scheduler's score: 0 (high) is taken first."""
    return {"high": 0, "normal": 1, "low": 2}[priority]


def _exhausted(max_attempts: int) -> dict[str, Any]:
    return {
        "code": "worker_lost",
        "message": f"the job was started {max_attempts} time(s) and never finished "
        "(its worker died or lost its lease each time); not retrying",
        "details": {"max_attempts": max_attempts},
    }


@dataclass(frozen=True)
class Taken:
    """What a free worker's take found: ``claimed`` (``job_id`` is now its attempt
    ``attempt``), ``exhausted`` (that job failed instead) or ``empty``; ``pool``: the
    pool's queue the job came from."""

    outcome: Literal["claimed", "exhausted", "empty"]
    job_id: str
    attempt: int
    pool: str = ""


def take(pools: list[str], *, worker: str, pool: str, lease_s: float, max_attempts: int,
         policy: str, weights: Mapping[str, float]) -> Call[Taken]:
    """Choose the next job of ``pools`` (in order) by the scheduler's policy and claim
    it as ``worker`` of ``pool``, in one atomic call."""
    now = time.time()
    keys, args = scripts.TAKE.pack({"served": SCHED_SERVED_KEY, "holds": SCHED_HOLDS_KEY}, {
        "pools_json": json.dumps(pools), "policy": policy,
        "weights_json": json.dumps(dict(weights)), "now_s": repr(now),
        "lease_until": repr(now + lease_s), "worker_json": json.dumps(worker),
        "max_attempts": max_attempts, "now_iso": json.dumps(now_iso()),
        "now_ms": _now_ms(now), "exhausted_error": json.dumps(_exhausted(max_attempts)),
        "job_prefix": job_key(""), "pool_json": json.dumps(pool), "hold_ms": HOLD_MS,
        "parts_prefix": parts_key(""),
    })

    def parse(reply: list[Any]) -> Taken:
        return Taken(cast(Any, text(reply[0])), text(reply[1]), int(reply[2]),
                     text(reply[3]))

    return Call(scripts.TAKE, keys, args, parse)


def claim(job_id: str, *, worker: str, lease_s: float, max_attempts: int,
          time_limit_s: float, pool: str | None = None) -> Call[Claim]:
    """Compare-and-set ``queued`` (or ``running`` with a lapsed lease) to ``running`` as
    the next attempt, or end the job when it must not run again."""
    now = time.time()
    exhausted = _exhausted(max_attempts)
    timed_out = {
        "code": "time_limit",
        "message": f"the job ran past its {time_limit_s:g} s time limit and was stopped",
        "details": {"limit_s": time_limit_s},
    }
    keys, args = scripts.CLAIM.pack({"job": job_key(job_id)}, {
        "id": job_id, "now_s": repr(now), "lease_until": repr(now + lease_s),
        "worker_json": json.dumps(worker), "max_attempts": max_attempts,
        "now_iso": json.dumps(now_iso()), "now_ms": _now_ms(now),
        "exhausted_error": json.dumps(exhausted),
        "time_limit_s": _NO_LIMIT if time_limit_s == float("inf") else repr(time_limit_s),
        "time_limit_error": json.dumps(timed_out), "pool_json": json.dumps(pool),
    })

    def parse(reply: list[Any]) -> Claim:
        return Claim(cast(ClaimOutcome, text(reply[0])), int(reply[1]))

    return Call(scripts.CLAIM, keys, args, parse)


def update(job_id: str, attempt: int, fields: Mapping[str, Any]) -> Call[int]:
    """Write ``fields`` if ``attempt`` still owns the job: 1 = cancel requested,
    0 = carry on, -1 = the job is no longer this attempt's."""
    keys, args = scripts.UPDATE.pack({"job": job_key(job_id)}, {"attempt": attempt},
                                     _pairs(fields))
    return Call(scripts.UPDATE, keys, args, int)


def transition(
    job_id: str, *, allowed: tuple[str, ...], to: str, attempt: int | None,
    fields: Mapping[str, Any] | None = None, metrics: Mapping[str, float] | None = None,
) -> Call[tuple[bool, str]]:
    """Move the job from one of ``allowed`` to ``to`` (only as ``attempt`` when given),
    writing ``fields`` and adding ``metrics`` to the metrics hash; (done, previous)."""
    metrics = metrics or {}
    mflat: list[Arg] = [x for k, v in metrics.items() for x in (k, repr(v))]
    keys, args = scripts.TRANSITION.pack(
        {"job": job_key(job_id), "metrics": METRICS_KEY},
        {"id": job_id, "allowed": " ".join(allowed), "to": to, "now_ms": _now_ms(),
         "attempt": "" if attempt is None else attempt, "n_metrics": len(metrics)},
        [*mflat, *_pairs(fields or {})],
    )

    def parse(reply: list[Any]) -> tuple[bool, str]:
        return text(reply[0]) == "ok", text(reply[1])

    return Call(scripts.TRANSITION, keys, args, parse)


def cancel(job_id: str) -> Call[CancelOutcome]:
    """End a queued job now; flag a running one (its worker stops at its next check)."""
    keys, args = scripts.CANCEL.pack(
        {"job": job_key(job_id)},
        {"id": job_id, "now_iso": json.dumps(now_iso()), "now_ms": _now_ms()},
    )

    def parse(reply: Any) -> CancelOutcome:
        return cast(CancelOutcome, text(reply))

    return Call(scripts.CANCEL, keys, args, parse)


def pin(job_id: str, owner: str, pinned: bool) -> Call[bool]:
    """Set or clear ``pinned``; False when the job is missing or another owner's."""
    keys, args = scripts.PIN.pack({"job": job_key(job_id)}, {
        "owner_json": json.dumps(owner), "value": "true" if pinned else "false"})
    return Call(scripts.PIN, keys, args, lambda reply: bool(int(reply)))


def reserve(job_id: str, owner: str, attempt: int, nbytes: int, *, quota: int | None,
            artifacts: tuple[str, ...] = ()) -> Call[tuple[ReserveOutcome, int]]:
    """Count ``nbytes`` of outputs against the owner's quota (replacing any earlier
    reservation of the job) and reference ``artifacts``; (outcome, owner's usage)."""
    keys, args = scripts.RESERVE.pack(
        {"job": job_key(job_id), "usage": usage_key(owner), "unreferenced": UNREFERENCED_KEY},
        {"id": job_id, "attempt": attempt, "bytes": nbytes,
         "quota": _NO_LIMIT if quota is None else quota, "refs_prefix": REFS_PREFIX,
         "now_ms": _now_ms()},
        list(artifacts),
    )

    def parse(reply: list[Any]) -> tuple[ReserveOutcome, int]:
        return cast(ReserveOutcome, text(reply[0])), int(reply[1])

    return Call(scripts.RESERVE, keys, args, parse)


def job_storage_prefix(job_id: str) -> str:
    """Where every attempt of a job publishes (``jobs/<id>/a<n>``): deleted as a whole."""
    return f"jobs/{job_id}/"


def remove(record: JobRecord, *, expire_before: float | None = None
           ) -> Call[tuple[RemoveOutcome, int]]:
    """Delete a finished job (``expire_before``: only if unpinned and finished before
    that epoch time); (outcome, bytes given back to the quota)."""
    owner = record.owner
    keys, args = scripts.REMOVE.pack(
        {"job": job_key(record.id), "owner": owner_key(owner),
         "idem": idem_key(owner, record.idempotency_key or ""), "usage": usage_key(owner),
         "unreferenced": UNREFERENCED_KEY, "orphans": ORPHANS_KEY,
         "requeue": requeue_key(record.id), "parts": parts_key(record.id)},
        {"id": record.id, "mode": "delete" if expire_before is None else "expire",
         "cutoff_ms": 0 if expire_before is None else _now_ms(expire_before),
         "refs_prefix": REFS_PREFIX, "prefix": job_storage_prefix(record.id),
         "now_ms": _now_ms()},
    )

    def parse(reply: list[Any]) -> tuple[RemoveOutcome, int]:
        return cast(RemoveOutcome, text(reply[0])), int(reply[1])

    return Call(scripts.REMOVE, keys, args, parse)


def touch_artifact(key: str) -> Call[None]:
    keys, args = scripts.TOUCH_ARTIFACT.pack(
        {"unreferenced": UNREFERENCED_KEY},
        {"key": key, "refs_prefix": REFS_PREFIX, "now_ms": _now_ms()})
    return Call(scripts.TOUCH_ARTIFACT, keys, args, lambda _reply: None)


def collect_artifact(key: str, *, unreferenced_before: float) -> Call[bool]:
    """True when artifact ``key`` is unreferenced since before that epoch time: it leaves
    the candidates and its objects may be deleted."""
    keys, args = scripts.COLLECT_ARTIFACT.pack(
        {"unreferenced": UNREFERENCED_KEY},
        {"key": key, "refs_prefix": REFS_PREFIX, "cutoff_ms": _now_ms(unreferenced_before)})
    return Call(scripts.COLLECT_ARTIFACT, keys, args, lambda reply: bool(int(reply)))
