"""The API's view of the job store (asyncio Redis): create, read, list, cancel, counts.

Reading a job is one ``HGETALL``; listing is one ``ZREVRANGEBYLEX`` plus one pipelined
batch of ``HGETALL`` per page.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Literal, cast

import redis.asyncio as aioredis

from app.jobs import scripts
from app.jobs.batching import HashReader
from app.jobs.record import (
    INTERNAL_FIELDS,
    METRICS_KEY,
    STATUSES,
    WORKERS_KEY,
    JobRecord,
    active_key,
    decode,
    encode,
    idem_key,
    job_key,
    now_iso,
    owner_key,
    status_key,
)

PUBLIC_FIELDS = tuple(f.encode() for f in JobRecord.model_fields if f not in INTERNAL_FIELDS)
CreateOutcome = Literal["created", "existing", "too_many"]
CancelOutcome = Literal["cancelled", "requested", "finished", "missing"]
# Upper bound on records examined for one filtered page, so a rare status cannot turn a
# list request into a scan of every job the key ever ran.
MAX_SCAN = 1000


@dataclass
class Page:
    jobs: list[JobRecord]
    next_cursor: str | None


class ApiJobStore:
    def __init__(self, client: aioredis.Redis) -> None:
        self.r = client
        self._reader = HashReader(client)
        self._create = client.register_script(scripts.CREATE)
        self._cancel = client.register_script(scripts.CANCEL)
        self._transition = client.register_script(scripts.TRANSITION)

    @classmethod
    def from_url(cls, url: str) -> ApiJobStore:
        return cls(aioredis.Redis.from_url(url, health_check_interval=30))

    async def close(self) -> None:
        await self.r.aclose()

    async def ping(self) -> bool:
        return bool(await self.r.ping())

    async def create(
        self, record: JobRecord, *, max_active: int
    ) -> tuple[CreateOutcome, str]:
        fields = encode(record.model_dump(mode="json"))
        flat: list[str] = [x for kv in fields.items() for x in kv]
        idem = idem_key(record.owner, record.idempotency_key or "")
        res = await self._create(
            keys=[job_key(record.id), owner_key(record.owner), active_key(record.owner),
                  status_key("queued"), idem],
            args=[record.id, max_active, "1" if record.idempotency_key else "0",
                  int(time.time() * 1000), *flat],
        )
        outcome, job_id = (x.decode() if isinstance(x, bytes) else str(x) for x in res)
        return outcome, job_id  # type: ignore[return-value]

    async def idempotent_job(self, owner: str, key: str) -> str | None:
        """The job id an earlier submission with this idempotency key created."""
        found = await self.r.get(idem_key(owner, key))
        return found.decode() if isinstance(found, bytes) else found

    async def count_submission(self, owner: str, window_s: int = 60) -> int:
        """Submissions by ``owner`` in the current fixed window (one pipelined call)."""
        bucket = int(time.time() // window_s)
        key = f"maec:rate:{owner}:{bucket}"
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.incr(key)
            pipe.expire(key, window_s * 2)
            count, _ = await pipe.execute()
        return int(count)

    async def get(self, job_id: str, owner: str | None = None) -> JobRecord | None:
        """The record, or None when missing or (with ``owner``) someone else's."""
        raw = await cast(Awaitable[dict[bytes, bytes]], self.r.hgetall(job_key(job_id)))
        rec = decode(raw)
        if rec is None or (owner is not None and rec.owner != owner):
            return None
        return rec

    async def get_public_json(self, job_id: str, owner: str) -> bytes | None:
        """The public Job as JSON bytes, or None (missing or another owner's).

        The hot read path (clients poll it): the hash values are already JSON text, so
        the body is assembled from them without parsing or re-serialising the record.
        """
        raw = await self._reader.hgetall(job_key(job_id))
        if not raw or raw.get(b"owner") != json.dumps(owner).encode():
            return None
        parts = [b'"' + name + b'":' + raw.get(name, b"null") for name in PUBLIC_FIELDS]
        return b"{" + b",".join(parts) + b"}"

    async def cancel(self, job_id: str) -> CancelOutcome:
        res = await self._cancel(
            keys=[job_key(job_id)],
            args=[job_id, encode({"t": now_iso()})["t"], int(time.time() * 1000)],
        )
        return (res.decode() if isinstance(res, bytes) else str(res))  # type: ignore[return-value]

    async def fail(self, job_id: str, error: dict[str, Any]) -> bool:
        """Fail a job that never reached the queue (enqueue error)."""
        fields = encode({"error": error, "finished_at": now_iso()})
        res = await self._transition(
            keys=[job_key(job_id), METRICS_KEY],
            args=[job_id, "queued", "failed", int(time.time() * 1000), "", 1,
                  "finished_total:failed", "1", *[x for kv in fields.items() for x in kv]],
        )
        return bool((res[0].decode() if isinstance(res[0], bytes) else res[0]) == "ok")

    async def list(
        self, owner: str, *, status: str | None, limit: int, cursor: str | None
    ) -> Page:
        """Newest first. ``cursor`` is the last id of the previous page."""
        out: list[JobRecord] = []
        upper = f"({cursor}" if cursor else "+"
        scanned = 0
        batch = limit if status is None else max(limit * 2, 50)
        last: str | None = None
        while len(out) < limit and scanned < MAX_SCAN:
            ids = [
                i.decode() if isinstance(i, bytes) else str(i)
                for i in await self.r.zrevrangebylex(
                    owner_key(owner), upper, "-", start=0, num=batch
                )
            ]
            if not ids:
                return Page(out, None)
            async with self.r.pipeline(transaction=False) as pipe:
                for i in ids:
                    pipe.hgetall(job_key(i))
                raws: list[Any] = await pipe.execute()
            for job_id, raw in zip(ids, raws, strict=True):
                scanned += 1
                last = job_id
                rec = decode(raw)
                if rec is not None and (status is None or rec.status == status):
                    out.append(rec)
                    if len(out) == limit:
                        break
            upper = f"({last}"
            if len(ids) < batch and len(out) < limit:
                return Page(out, None)
        # A full page (or the scan bound) ends here; more may follow.
        more = await self.r.zrevrangebylex(owner_key(owner), f"({last}", "-", start=0, num=1)
        return Page(out, last if more else None)

    async def status_counts(self) -> dict[str, int]:
        async with self.r.pipeline(transaction=False) as pipe:
            for s in STATUSES:
                pipe.zcard(status_key(s))
            counts = await pipe.execute()
        return dict(zip(STATUSES, (int(c) for c in counts), strict=True))

    async def metrics_hash(self) -> dict[str, float]:
        raw = await cast(Awaitable[dict[bytes, bytes]], self.r.hgetall(METRICS_KEY))
        return {
            (k.decode() if isinstance(k, bytes) else k): float(v) for k, v in raw.items()
        }

    async def live_workers(self, window_s: float) -> int:
        """Workers whose heartbeat is newer than ``window_s`` seconds."""
        return int(await self.r.zcount(WORKERS_KEY, time.time() - window_s, "+inf"))
