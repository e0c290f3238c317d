"""The API's face of the job store (asyncio Redis): create, read, list, cancel, counts,
pin, delete and the storage quota's usage.

Reading a job is one ``HGETALL`` (auto-pipelined with concurrent reads); listing is one
``ZREVRANGEBYLEX`` plus one pipelined batch of ``HGETALL`` per page. State changes run the
scripts of :mod:`app.jobs.calls`, shared with the worker.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import redis.asyncio as aioredis
from pydantic import ValidationError

from app.jobs import calls, scripts
from app.jobs.accounting import finish_increments
from app.jobs.batching import HashReader
from app.jobs.calls import CancelOutcome, CreateOutcome, RemoveOutcome
from app.jobs.keys import (
    METRICS_KEY,
    ORPHANS_KEY,
    WORKERS_KEY,
    idem_key,
    job_key,
    owner_key,
    status_key,
    usage_key,
)
from app.jobs.record import (
    INTERNAL_FIELDS,
    STATUSES,
    JobRecord,
    decode,
    encode,
    now_iso,
    text,
)
from maec_contract import with_file_urls
from maec_core.service import MaecError

T = TypeVar("T")
# Reads a queued job's place from its raw record (app.scheduler.view.QueueView.place).
Place = Callable[[dict[bytes, bytes]], Awaitable[dict[str, Any] | None]]
PUBLIC_FIELDS = tuple(f.encode() for f in JobRecord.model_fields if f not in INTERNAL_FIELDS)
# What a public field reads as when its record predates it (e.g. ``pinned``): the
# field's default, as JSON, so old records still parse as the contract's Job.
_DEFAULTS: dict[bytes, bytes] = {
    name.encode(): json.dumps(value, separators=(",", ":")).encode()
    for name, value in JobRecord(id="", owner="", method="", recipe={}, created_at=""
                                 ).model_dump(mode="json").items()
}
# A page's raw records (id, hash) and JSON bodies (the store's ``list`` method shadows
# the builtin inside the class).
Found = list[tuple[str, dict[bytes, bytes]]]
Bodies = list[bytes]
# Upper bound on records examined for one filtered page, so a rare status cannot turn a
# list request into a scan of every job the key ever ran.
MAX_SCAN = 1000
# Served results kept (:func:`served_result`): a few hundred polled jobs' worth.
SERVED_RESULTS = 512


class UnreadableJob(MaecError):
    """The job's stored record holds text that cannot be sent as strict JSON (a lone
    UTF-16 surrogate, bytes that are not UTF-8): only a record stored before submissions
    were checked for it can. The job can still be cancelled and deleted."""

    code = "job_unreadable"


@functools.lru_cache(maxsize=SERVED_RESULTS)
def served_result(stored: bytes, job_id: str) -> bytes:
    """A stored ``result`` as the API serves it: its files given their URLs
    (``maec_contract.with_file_urls``). A result never changes once stored, and clients
    poll it, so each is parsed once and its served form kept (a small LRU). Text that
    does not parse is passed on as it is: :func:`public_json` judges it."""
    try:
        doc = json.loads(stored)
    except (ValueError, RecursionError):
        return stored
    if not isinstance(doc, dict):
        return stored
    served = with_file_urls(doc, job_id)
    return stored if served is doc else json.dumps(served, separators=(",", ":")).encode()


def _assemble(raw: Mapping[bytes, bytes], job_id: str) -> bytes:
    result = raw.get(b"result")
    if result is not None and result != b"null":
        raw = {**raw, b"result": served_result(result, job_id)}
    parts = [b'"' + name + b'":' + raw.get(name, _DEFAULTS[name]) for name in PUBLIC_FIELDS]
    return b"{" + b",".join(parts) + b"}"


def public_json(raw: Mapping[bytes, bytes], job_id: str) -> bytes:
    """The public Job of a raw record, as the job route and the list both send it.

    The store writes every field with ``json.dumps``' ASCII escapes, so a record it
    wrote is ASCII and holds no ``\\u`` escape of a surrogate unless it holds a character
    outside the Basic Multilingual Plane (escaped as a pair) or a lone surrogate. Only
    then is the body parsed and re-encoded strictly; the common body passes unparsed.
    Raises UnreadableJob when the text is not strict JSON."""
    body = _assemble(raw, job_id)
    if body.isascii() and b"\\ud" not in body:
        return body
    try:
        # bytes are decoded with "surrogatepass"; the strict encode refuses any surrogate
        # left unpaired, whether it arrived escaped or as raw bytes.
        json.dumps(json.loads(body), ensure_ascii=False).encode("utf-8")
    except (ValueError, UnicodeError, RecursionError):
        raise UnreadableJob(
            f"job {job_id}'s record holds text that cannot be sent as JSON (stored before "
            "submissions were checked for it); it can still be cancelled and deleted",
            job_id=job_id) from None
    return body


def _repaired(value: Any) -> Any:
    """``value`` with every lone surrogate replaced by U+FFFD."""
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, list):
        return [_repaired(v) for v in value]
    if isinstance(value, dict):
        return {_repaired(k): _repaired(v) for k, v in value.items()}
    return value


DEGRADED_WARNING = ("this job's record holds text that is not valid Unicode (stored "
                    "before submissions were checked for it): shown with U+FFFD in its "
                    "place; GET /v1/jobs/{id} answers 409 job_unreadable")


def degraded_raw(raw: Mapping[bytes, bytes], job_id: str) -> dict[bytes, bytes]:
    """The degraded form of a record :func:`public_json` refuses, still a raw record:
    every field that parses, with lone surrogates (and bytes that are not UTF-8, read as
    such) replaced by U+FFFD; a field that does not parse at all is left out (it takes
    its default); ``id`` the job's, and a line in ``warnings`` saying so."""
    out: dict[bytes, bytes] = {}
    for name, value in raw.items():
        try:
            doc = json.loads(value.decode("utf-8", "surrogateescape"))
        except (ValueError, RecursionError):
            continue
        out[name] = json.dumps(_repaired(doc), separators=(",", ":")).encode()
    warnings = json.loads(out.get(b"warnings", b"[]"))
    out[b"warnings"] = json.dumps(
        [*(warnings if isinstance(warnings, list) else []), DEGRADED_WARNING]).encode()
    out[b"id"] = json.dumps(job_id).encode()
    return out


def degraded_json(raw: Mapping[bytes, bytes], job_id: str) -> bytes:
    """The public Job of :func:`degraded_raw`: what the list shows for such a record."""
    return _assemble(degraded_raw(raw, job_id), job_id)


def record_json(record: JobRecord) -> bytes:
    """The public Job of a decoded record, serialised as :func:`public_json` serialises
    a stored one (its degraded form when that refuses it): what the routes that answer
    with a job after changing it (cancel, pin, submit) send."""
    raw = {k.encode(): v.encode() for k, v in encode(record.public()).items()}
    try:
        return public_json(raw, record.id)
    except UnreadableJob:
        return degraded_json(raw, record.id)


@dataclass
class Page:
    jobs: list[JobRecord]
    next_cursor: str | None


class ApiJobStore:
    def __init__(self, client: aioredis.Redis) -> None:
        self._r = client
        self._reader = HashReader(client)
        self._scripts = {s.name: client.register_script(s.lua) for s in scripts.ALL}

    @classmethod
    def from_url(cls, url: str) -> ApiJobStore:
        return cls(aioredis.Redis.from_url(url, health_check_interval=30))

    @property
    def client(self) -> aioredis.Redis:
        """The connection pool, for other API pieces that keep state in the same Redis
        (one pool per process); job keys are only ever touched through this store."""
        return self._r

    async def close(self) -> None:
        await self._r.aclose()

    async def ping(self) -> bool:
        return bool(await self._r.ping())

    async def _run(self, call: calls.Call[T]) -> T:
        return call.parse(await self._scripts[call.script.name](keys=call.keys,
                                                                 args=call.args))

    async def create(
        self, record: JobRecord, *, max_active: int, weights: Mapping[str, float],
        credit: int = 0,
    ) -> tuple[CreateOutcome, str]:
        return await self._run(calls.create(record, max_active=max_active, weights=weights,
                                            credit=credit))

    async def idempotent_job(self, owner: str, key: str) -> str | None:
        """The job id an earlier submission with this idempotency key created."""
        found = await self._r.get(idem_key(owner, key))
        return None if found is None else text(found)

    async def get(self, job_id: str, owner: str | None = None) -> JobRecord | None:
        """The record, or None when missing or (with ``owner``) someone else's."""
        raw = await cast(Awaitable[dict[bytes, bytes]], self._r.hgetall(job_key(job_id)))
        rec = decode(raw)
        if rec is None or (owner is not None and rec.owner != owner):
            return None
        return rec

    async def get_shown(self, job_id: str, owner: str) -> JobRecord | None:
        """The record as pages show it: :meth:`get`, except that a record
        :func:`public_json` refuses comes in its degraded form (:func:`degraded_raw`), so
        a page rendered from it can be encoded. Never for changing the job."""
        raw = await cast(Awaitable[dict[bytes, bytes]], self._r.hgetall(job_key(job_id)))
        if not raw or raw.get(b"owner") != json.dumps(owner).encode():
            return None
        try:
            public_json(raw, job_id)
        except UnreadableJob:
            raw = degraded_raw(raw, job_id)
        return decode(raw)

    async def get_public_json(self, job_id: str, owner: str,
                              place: Place | None = None) -> bytes | None:
        """The public Job as JSON bytes, or None (missing or another owner's).

        The hot read path (clients poll it): the hash values are already JSON text, so
        the body is assembled from them without parsing or re-serialising the record.
        ``place`` fills ``queue`` of a queued job (its position and ETA, read from the
        scheduler) from the raw record; nothing else is read for a job that has started.
        Raises UnreadableJob for a record that cannot be sent as strict JSON
        (:func:`public_json`).
        """
        raw = await self._reader.hgetall(job_key(job_id))
        if not raw or raw.get(b"owner") != json.dumps(owner).encode():
            return None
        if place is not None and raw.get(b"status") == b'"queued"':
            where = await place(raw)
            if where is not None:
                raw = {**raw, b"queue": json.dumps(where, separators=(",", ":")).encode()}
        return public_json(raw, job_id)

    async def cancel(self, job_id: str) -> CancelOutcome:
        return await self._run(calls.cancel(job_id))

    async def fail(self, job_id: str, error: dict[str, Any]) -> bool:
        """Fail a job that never reached the queue (enqueue error)."""
        done, _ = await self._run(calls.transition(
            job_id, allowed=("queued",), to="failed", attempt=None,
            fields={"error": error, "finished_at": now_iso()},
            metrics=finish_increments("failed", None),
        ))
        return done

    async def list(
        self, owner: str, *, status: str | None, limit: int, cursor: str | None
    ) -> Page:
        """Newest first. ``cursor`` is the last id of the previous page."""
        found, next_cursor = await self._scan(owner, status=status, limit=limit,
                                              cursor=cursor)
        jobs: list[JobRecord] = []
        for job_id, raw in found:
            try:
                public_json(raw, job_id)
            except UnreadableJob:
                # Its degraded form, so a page rendered from records (the /ui list)
                # shows it as the REST list does instead of failing to encode.
                raw = degraded_raw(raw, job_id)
            try:
                rec = decode(raw)
            except ValidationError:  # a field the degraded form could not keep
                continue
            if rec is not None:
                jobs.append(rec)
        return Page(jobs, next_cursor)

    async def list_public_json(
        self, owner: str, *, status: str | None, limit: int, cursor: str | None
    ) -> bytes:
        """One page of ``GET /v1/jobs`` as JSON bytes: each job serialised as
        :meth:`get_public_json` serialises it (:func:`public_json`), so a page answers
        whenever each of its jobs' own reads would; a record that cannot be sent strictly
        is shown in its degraded form (:func:`degraded_json`) rather than failing the
        page."""
        found, next_cursor = await self._scan(owner, status=status, limit=limit,
                                              cursor=cursor)
        jobs: Bodies = []
        for job_id, raw in found:
            try:
                jobs.append(public_json(raw, job_id))
            except UnreadableJob:
                jobs.append(degraded_json(raw, job_id))
        return (b'{"jobs":[' + b",".join(jobs) + b'],"next_cursor":'
                + json.dumps(next_cursor).encode() + b"}")

    async def _scan(
        self, owner: str, *, status: str | None, limit: int, cursor: str | None
    ) -> tuple[Found, str | None]:
        """The raw records of one page, newest first, and the next page's cursor."""
        out: Found = []
        upper = f"({cursor}" if cursor else "+"
        scanned = 0
        batch = limit if status is None else max(limit * 2, 50)
        wanted = None if status is None else json.dumps(status).encode()
        mine = json.dumps(owner).encode()
        last: str | None = None
        while len(out) < limit and scanned < MAX_SCAN:
            found = await self._r.zrevrangebylex(owner_key(owner), upper, "-", start=0,
                                                 num=batch)
            ids = [text(i) for i in found]
            if not ids:
                return out, None
            async with self._r.pipeline(transaction=False) as pipe:
                for i in ids:
                    pipe.hgetall(job_key(i))
                raws: list[Any] = await pipe.execute()
            for job_id, raw in zip(ids, raws, strict=True):
                scanned += 1
                last = job_id
                # An empty hash: the job was deleted between the two reads. The list
                # names ids; the record says whose job it is, and only that is trusted
                # (an index entry left by anything else lists nothing).
                if raw and raw.get(b"owner") == mine and (
                        wanted is None or raw.get(b"status") == wanted):
                    out.append((job_id, raw))
                    if len(out) == limit:
                        break
            upper = f"({last}"
            if len(ids) < batch and len(out) < limit:
                return out, None
        # A full page (or the scan bound) ends here; more may follow.
        more = await self._r.zrevrangebylex(owner_key(owner), f"({last}", "-", start=0, num=1)
        return out, (last if more else None)

    async def status_counts(self) -> dict[str, int]:
        async with self._r.pipeline(transaction=False) as pipe:
            for s in STATUSES:
                pipe.zcard(status_key(s))
            counts = await pipe.execute()
        return dict(zip(STATUSES, (int(c) for c in counts), strict=True))

    async def metrics_hash(self) -> dict[str, float]:
        raw = await cast(Awaitable[dict[bytes, bytes]], self._r.hgetall(METRICS_KEY))
        return {text(k): float(v) for k, v in raw.items()}

    async def live_workers(self, window_s: float) -> int:
        """Workers whose heartbeat is newer than ``window_s`` seconds."""
        return int(await self._r.zcount(WORKERS_KEY, time.time() - window_s, "+inf"))

    async def pin(self, job_id: str, owner: str, pinned: bool) -> bool:
        """Set or clear the job's ``pinned`` flag; False when missing or another's."""
        return await self._run(calls.pin(job_id, owner, pinned))

    async def remove(self, record: JobRecord) -> tuple[RemoveOutcome, int]:
        """Delete a finished job's record and index entries, queueing its storage prefix
        (:func:`app.jobs.calls.remove`); the caller deletes the files next."""
        return await self._run(calls.remove(record))

    async def outputs_deleted(self, prefix: str) -> None:
        """The removed job's files are gone: nothing is left for the workers to retry."""
        await cast(Awaitable[int], self._r.srem(ORPHANS_KEY, prefix))

    async def usage(self, owner: str) -> int:
        """Bytes of published outputs ``owner``'s jobs hold (storage quota)."""
        raw = await self._r.get(usage_key(owner))
        return 0 if raw is None else int(raw)
