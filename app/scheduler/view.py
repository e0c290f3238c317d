"""The scheduler as callers see it (read-only, asyncio Redis): a queued job's place and
ETA, the queue summary of ``GET /v1/queue`` and the per-pool and per-key gauges.

Position: the jobs the scheduler would start before this one. Under ``fair`` that is
every queued job of a higher priority band in the job's pool, the owner's own older jobs
of its band (``k``), and from each other owner of the band one job per round before this
job's round (``k``), and in its round too when that owner's job is the older; under
``fifo``, every job queued before it. An estimate: running work shifts turns between
keys.

ETA: ``ceil((position + 1) / workers) * median`` seconds, where ``workers`` are the live
workers that take this pool's jobs (its own and those of the pools covering it) and
``median`` the median duration of those pools' recent jobs. Unknown (null) while no
such worker is live (a pool scaled to zero) or none has finished a job yet.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis

from app.jobs.calls import band
from app.jobs.keys import (
    BAND_SPAN,
    job_key,
    sched_done_key,
    sched_owners_key,
    sched_queue_key,
    sched_workers_key,
    status_key,
)
from app.jobs.record import text
from app.scheduler.pools import served_by
from app.settings import Settings
from maec_contract import QueueSummary

BANDS = (0, 1, 2)
# At most this many of the caller's queued jobs are listed by GET /v1/queue.
MAX_LISTED = 100


def _loads(raw: bytes | None) -> Any:
    return None if raw is None else json.loads(raw)


@dataclass
class PoolState:
    queued: int
    active: int
    workers: int
    median_job_s: float | None


class QueueView:
    def __init__(self, client: aioredis.Redis, settings: Settings) -> None:
        self._r = client
        self._s = settings

    # -- one job -------------------------------------------------------------------

    async def _owners(self, pool: str) -> list[str]:
        members = await cast(Awaitable[set[bytes]], self._r.smembers(sched_owners_key(pool)))
        return sorted(text(o) for o in members)

    async def position(self, pool: str, owner: str, priority: str, seq: int) -> int:
        owners = await self._owners(pool)
        b = band(priority)
        lo, hi = b * BAND_SPAN, (b + 1) * BAND_SPAN - 1
        async with self._r.pipeline(transaction=False) as pipe:
            for o in owners:
                q = sched_queue_key(pool, o)
                if self._s.scheduler_policy == "fifo":
                    for other in BANDS:
                        pipe.zcount(q, other * BAND_SPAN, other * BAND_SPAN + seq - 1)
                else:
                    pipe.zcount(q, "-inf", lo - 1)
                    pipe.zcount(q, lo, hi)
                    pipe.zcount(q, lo, f"({lo + seq}")
            counts = [int(c) for c in await pipe.execute()]
        if self._s.scheduler_policy == "fifo":
            return sum(counts)
        per = {o: counts[3 * i:3 * i + 3] for i, o in enumerate(owners)}
        k = per.get(owner, [0, 0, 0])[2]
        # Each other owner gets k turns before this job's round, and the turn of this
        # round too when its job of that round is the older one.
        return sum(higher for higher, _, _ in per.values()) + k + sum(
            min(same, k + (1 if earlier > k else 0))
            for o, (_, same, earlier) in per.items() if o != owner)

    def _takers(self, pool: str) -> list[str]:
        """The pools whose workers take ``pool``'s jobs."""
        return [p for p in self._s.pools if pool in served_by(p, self._s.pools)]

    async def round_size(self, pool: str) -> int:
        """How many jobs of ``pool`` one round of the fleet starts: the live workers
        that take its jobs (a newcomer's credit in the fair share)."""
        return (await self._workers_and_median(self._takers(pool)))[0]

    async def _workers_and_median(self, pools: list[str]) -> tuple[int, float | None]:
        since = time.time() - 3 * self._s.worker_heartbeat_seconds
        async with self._r.pipeline(transaction=False) as pipe:
            for p in pools:
                pipe.zcount(sched_workers_key(p), since, "+inf")
                pipe.lrange(sched_done_key(p), 0, -1)
            out = await pipe.execute()
        workers = sum(int(n) for n in out[0::2])
        durations = [float(d) for ds in out[1::2] for d in ds]
        return workers, (statistics.median(durations) if durations else None)

    async def place(self, fields: Mapping[bytes, bytes]) -> dict[str, Any] | None:
        """``{position, eta_s, pool}`` of a queued job from its raw record, or None."""
        pool = _loads(fields.get(b"pool"))
        if _loads(fields.get(b"status")) != "queued" or not pool or pool not in self._s.pools:
            return None
        owner = str(_loads(fields.get(b"owner")))
        priority = str(_loads(fields.get(b"priority")) or "normal")
        seq = int(_loads(fields.get(b"seq")) or 0)
        position = await self.position(pool, owner, priority, seq)
        workers, median = await self._workers_and_median(self._takers(pool))
        eta = None if not workers or median is None else round(
            math.ceil((position + 1) / workers) * median, 1)
        return {"position": position, "eta_s": eta, "pool": pool}

    # -- the whole queue -------------------------------------------------------------

    async def running_by(self) -> list[tuple[str, str | None, int]]:
        """(owner, pool that runs it, cost) of every running or publishing job."""
        async with self._r.pipeline(transaction=False) as pipe:
            for st in ("running", "publishing"):
                pipe.zrange(status_key(st), 0, -1)
            ids = [text(i) for part in await pipe.execute() for i in part]
        if not ids:
            return []
        async with self._r.pipeline(transaction=False) as pipe:
            for i in ids:
                pipe.hmget(job_key(i), ["owner", "ran_pool", "cost"])
            rows = await pipe.execute()
        return [(str(_loads(o)), _loads(p), int(_loads(c) or 1))
                for o, p, c in rows if o is not None]

    async def queued_by(self) -> dict[str, dict[str, int]]:
        """pool -> owner -> queued jobs."""
        out: dict[str, dict[str, int]] = {}
        for pool in self._s.pools:
            owners = await self._owners(pool)
            async with self._r.pipeline(transaction=False) as pipe:
                for o in owners:
                    pipe.zcard(sched_queue_key(pool, o))
                counts = await pipe.execute()
            out[pool] = {o: int(n) for o, n in zip(owners, counts, strict=True) if int(n)}
        return out

    async def pools(self, running: list[tuple[str, str | None, int]],
                    queued: dict[str, dict[str, int]]) -> dict[str, PoolState]:
        out: dict[str, PoolState] = {}
        for pool in self._s.pools:
            workers, median = await self._workers_and_median([pool])
            out[pool] = PoolState(
                queued=sum(queued.get(pool, {}).values()),
                active=sum(1 for _, p, _ in running if p == pool),
                workers=workers, median_job_s=None if median is None else round(median, 3))
        return out

    async def summary(self, owner: str) -> QueueSummary:
        """``GET /v1/queue``: the caller's jobs (counts, and each queued one's place)
        and every pool's depth, active count and live workers; no other key's jobs."""
        running = await self.running_by()
        queued = await self.queued_by()
        pools = await self.pools(running, queued)
        mine: list[dict[str, Any]] = []
        for pool, per in queued.items():
            if per.get(owner):
                mine += await self._own_queued(pool, owner)
        mine.sort(key=lambda j: (j["position"], j["id"]))
        return QueueSummary.model_validate({
            "key": owner,
            "policy": self._s.scheduler_policy,
            "jobs": {"queued": sum(per.get(owner, 0) for per in queued.values()),
                     "running": sum(1 for o, _, _ in running if o == owner),
                     "running_cost": sum(c for o, _, c in running if o == owner)},
            "queued": mine[:MAX_LISTED],
            "pools": {name: {**vars(state), **self._s.pools[name].model_dump()}
                      for name, state in pools.items()},
        })

    async def _own_queued(self, pool: str, owner: str) -> list[dict[str, Any]]:
        ids = [text(i) for i in await self._r.zrange(sched_queue_key(pool, owner), 0,
                                                     MAX_LISTED - 1)]
        out = []
        mine = json.dumps(owner).encode()
        for i in ids:
            raw = await cast(Awaitable[dict[bytes, bytes]], self._r.hgetall(job_key(i)))
            if raw.get(b"owner") != mine:
                continue  # listed only if the record says it is the caller's
            where = await self.place(raw)
            if where is not None:
                out.append({"id": i, "name": _loads(raw.get(b"name")),
                            "priority": _loads(raw.get(b"priority")), **where})
        return out
