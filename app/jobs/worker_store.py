"""The worker's view of the job store (sync Redis): claim, progress, transitions.

Every write is guarded by the attempt number the claim returned, so a worker that lost
its lease (and whose job a redelivered message re-claimed) cannot overwrite the record.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal, cast

import redis

from app.jobs import scripts
from app.jobs.record import (
    METRICS_KEY,
    WORKERS_KEY,
    JobRecord,
    decode,
    encode,
    job_key,
    now_iso,
)

ClaimOutcome = Literal["claimed", "busy", "done", "missing", "cancelled", "exhausted",
                       "time_limit"]


@dataclass(frozen=True)
class Claim:
    outcome: ClaimOutcome
    attempt: int


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


class WorkerJobStore:
    def __init__(self, client: redis.Redis) -> None:
        self.r = client
        self._claim = client.register_script(scripts.CLAIM)
        self._update = client.register_script(scripts.UPDATE)
        self._transition = client.register_script(scripts.TRANSITION)

    @classmethod
    def from_url(cls, url: str) -> WorkerJobStore:
        return cls(redis.Redis.from_url(url, health_check_interval=30))

    def get(self, job_id: str) -> JobRecord | None:
        raw = cast(dict[bytes, bytes], self.r.hgetall(job_key(job_id)))
        return decode(raw)

    def claim(
        self, job_id: str, *, worker: str, lease_s: float, max_attempts: int,
        time_limit_s: float = float("inf"),
    ) -> Claim:
        now = time.time()
        exhausted = {
            "code": "worker_lost",
            "message": f"the job was started {max_attempts} time(s) and never finished "
            "(its worker died or lost its lease each time); not retrying",
            "details": {"max_attempts": max_attempts},
        }
        timed_out = {
            "code": "time_limit",
            "message": f"the job ran past its {time_limit_s:g} s time limit and was stopped",
            "details": {"limit_s": time_limit_s},
        }
        res = self._claim(
            keys=[job_key(job_id)],
            args=[job_id, repr(now), repr(now + lease_s), json.dumps(worker), max_attempts,
                  json.dumps(now_iso()), int(now * 1000), json.dumps(exhausted),
                  repr(time_limit_s) if time_limit_s != float("inf") else "1e300",
                  json.dumps(timed_out)],
        )
        return Claim(_s(res[0]), int(res[1]))  # type: ignore[arg-type]

    def update(self, job_id: str, attempt: int, fields: dict[str, Any]) -> int:
        """Write ``fields`` if ``attempt`` still owns the job. 1 = cancel requested,
        0 = carry on, -1 = the job is no longer ours."""
        flat = [x for kv in encode(fields).items() for x in kv]
        return int(self._update(keys=[job_key(job_id)], args=[attempt, *flat]))

    def transition(
        self,
        job_id: str,
        *,
        allowed: tuple[str, ...],
        to: str,
        attempt: int | None,
        fields: dict[str, Any] | None = None,
        metrics: dict[str, float] | None = None,
    ) -> tuple[bool, str]:
        """Atomically move the job from one of ``allowed`` to ``to``; (done, previous)."""
        flat = [x for kv in encode(fields or {}).items() for x in kv]
        mflat = [x for kv in (metrics or {}).items() for x in (kv[0], repr(kv[1]))]
        res = self._transition(
            keys=[job_key(job_id), METRICS_KEY],
            args=[job_id, " ".join(allowed), to, int(time.time() * 1000),
                  "" if attempt is None else attempt, len(metrics or {}), *mflat, *flat],
        )
        return _s(res[0]) == "ok", _s(res[1])

    def cancel_requested(self, job_id: str) -> bool:
        return cast(bytes | None, self.r.hget(job_key(job_id), "cancel_requested")) == b"true"

    def heartbeat(self, worker: str) -> None:
        now = time.time()
        pipe = self.r.pipeline(transaction=False)
        pipe.zadd(WORKERS_KEY, {worker: now})
        # Workers killed without a clean shutdown never remove themselves.
        pipe.zremrangebyscore(WORKERS_KEY, "-inf", now - 86400)
        pipe.execute()

    def forget_worker(self, worker: str) -> None:
        self.r.zrem(WORKERS_KEY, worker)
