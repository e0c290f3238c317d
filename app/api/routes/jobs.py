"""/v1/jobs: submit, read, list, cancel, pin, delete."""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from app.api.bounds import MAX_ID_CHARS, bounded_sizes, shown
from app.api.deps import Auth, Caller, identify
from app.api.errors import ApiError
from app.api.schemas import (
    LIST_LINKS,
    PROBLEMS,
    SUBMIT_LINKS,
    JobBody,
    JobList,
    JobOut,
    Problem,
    to_request,
)
from app.jobs.api_store import record_json
from app.jobs.calls import job_storage_prefix
from app.jobs.record import STATUSES, JobRecord, new_job_id, now_iso
from app.kinds import submission_of
from app.scheduler.pools import route
from app.settings import PRIORITIES, Settings
from app.sources import Published, published
from app.storage.base import StorageError
from app.webhooks.delivery import accept_callback

log = logging.getLogger("maec.api")
router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=PROBLEMS)


def not_found(job_id: str) -> ApiError:
    # The same answer for "absent" and "another key's": ids are not an oracle.
    return ApiError(404, "job_not_found", f"no job {shown(job_id)}", job_id=shown(job_id))


def check_id(job_id: str) -> None:
    """An id too long to be one names no job: 404 before any lookup."""
    if len(job_id) > MAX_ID_CHARS:
        raise not_found(job_id)


def _job(rec: JobRecord, status: int = 200, headers: dict[str, str] | None = None
         ) -> Response:
    # Serialised as GET /v1/jobs/{id} serialises the stored record (app/jobs/api_store).
    return Response(record_json(rec), status_code=status, headers=headers,
                    media_type="application/json")


@router.get("/{job_id}", response_model=JobOut)
async def get_job(job_id: str, request: Request) -> Response:
    """The job; clients poll this. Authenticated by calling ``identify`` directly
    instead of declaring it as a dependency: resolving one dependency costs about 25 us
    per request, a sixth of this route's CPU (bench/api.py), and this is the route the
    service answers most. Same check, same 401s; the rate-limit check runs alongside the
    read (both are Redis round trips) and is awaited before anything is answered."""
    auth = await identify(request)
    if len(job_id) > MAX_ID_CHARS:
        await auth.admitted()
        raise not_found(job_id)
    try:
        body = await auth.svc.store.get_public_json(job_id, auth.owner,
                                                    auth.svc.queue.place)
    finally:
        # Awaited whatever the read gave (an unreadable record's 409 included).
        await auth.admitted()
    if body is None:
        raise not_found(job_id)
    return Response(body, media_type="application/json")


@router.post("", status_code=202, response_model=JobOut, responses={
    200: {"model": JobOut, "description": "idempotent replay", "links": SUBMIT_LINKS},
    202: {"links": SUBMIT_LINKS},
    409: {"model": Problem, "description": "the idempotency key is held by a job this key "
          "does not own (`idempotency_conflict`)"},
    403: {"model": Problem, "description": "priority above the key's cap "
          "(`priority_not_allowed`)"},
})
async def submit(typed: JobBody, auth: Auth) -> Response:
    """Validate (schema, parameters, sources, headers) and queue a merge job."""
    owner, svc = auth.owner, auth.svc
    body = to_request(typed)
    if body.idempotency_key:
        # A replay answers with the job even if its sources changed since.
        earlier = await svc.store.idempotent_job(owner, body.idempotency_key)
        rec = await svc.store.get(earlier, owner) if earlier else None
        if rec is not None:
            return _job(rec, 200, {"Location": f"/v1/jobs/{rec.id}"})
    await svc.limits.submission(owner)
    await _check_quota(auth)
    priority = _priority(body.priority, owner, svc.settings)
    job = submission_of(bounded_sizes(body))
    if body.callback_url is not None:  # resolves the host: blocking
        await run_in_threadpool(accept_callback, body.callback_url, svc.settings, owner)
    outputs = await _own_outputs(auth, job.references())
    sources, need, notes = await run_in_threadpool(job.check_sources, svc.settings,
                                                   svc.storage, outputs)
    # Refused here (no_capable_worker) rather than sent to a worker to fail.
    pool = route(need, svc.settings.pools)
    record = JobRecord(
        id=new_job_id(), owner=owner, method=job.method, name=body.name or job.name,
        recipe=job.record_recipe(), warnings=job.warnings() + notes, sources=sources,
        created_at=now_iso(),
        idempotency_key=body.idempotency_key,
        callback_url=body.callback_url,
        pinned=bool(body.pinned), priority=priority, pool=pool,
        estimate=need.to_dict(), cost=need.cost,
    )
    outcome, job_id = await svc.store.create(
        record, max_active=svc.settings.max_active_jobs_per_key,
        weights=svc.settings.key_weights,
        credit=await svc.queue.round_size(pool) if pool else 0,
    )
    if outcome == "too_many":
        raise ApiError(429, "too_many_jobs",
                       f"key {owner} already has {svc.settings.max_active_jobs_per_key} "
                       "active jobs; wait for some to finish", headers={"Retry-After": "30"},
                       limit=svc.settings.max_active_jobs_per_key)
    if outcome == "conflict":
        # Only a store written by an older key layout can get here (the slot's name now
        # holds the owner exactly). Never another key's job, nor its id.
        raise ApiError(409, "idempotency_conflict",
                       "this idempotency key is held by a job of another key; use another "
                       "idempotency key")
    if outcome == "existing":
        # Read with the owner: the replay answers only with the caller's own job.
        existing = await svc.store.get(job_id, owner)
        if existing is None:  # deleted since the script found it
            raise not_found(job_id)
        return _job(existing, 200, {"Location": f"/v1/jobs/{job_id}"})
    try:
        await run_in_threadpool(svc.enqueuer.wake, pool)
    except Exception as exc:
        log.error("enqueue of %s failed: %s", job_id, exc)
        await svc.store.fail(job_id, {"code": "unavailable",
                                      "message": "the job queue is unreachable",
                                      "details": {}})
        raise ApiError(503, "unavailable", "the job queue is unreachable; retry later",
                       headers={"Retry-After": "5"}) from None
    log.info("job %s queued for %s (%s, pool %s, %s)", job_id, owner, record.method, pool,
             priority)
    return _job(record, 202, {"Location": f"/v1/jobs/{job_id}"})


@router.get("", response_model=JobList, responses={200: {"links": LIST_LINKS}})
async def list_jobs(
    auth: Auth,
    status: Annotated[str | None, Query(max_length=32)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    cursor: Annotated[str | None, Query(max_length=64, pattern=r"^j_[0-9a-f]+$")] = None,
) -> Response:
    """The caller's jobs, newest first; pass ``next_cursor`` back for the next page."""
    owner, svc = auth.owner, auth.svc
    if status is not None and status not in STATUSES:
        raise ApiError(422, "invalid_request",
                       f"status must be one of {', '.join(STATUSES)}", status=status)
    # Each job serialised as GET /v1/jobs/{id} serialises it, so one record that cannot
    # be sent strictly shows in its degraded form instead of failing the page.
    body = await svc.store.list_public_json(owner, status=status, limit=limit,
                                            cursor=cursor)
    return Response(body, media_type="application/json")


@router.post("/{job_id}/cancel", status_code=202, response_model=JobOut)
async def cancel_job(job_id: str, auth: Auth) -> Response:
    """Queued jobs end at once; running ones stop at their next tensor and clean up.

    Idempotent: cancelling a cancelled job answers as the first cancel did, so a client
    whose first response was lost can retry. A job that succeeded or failed is a 409."""
    owner, svc = auth.owner, auth.svc
    check_id(job_id)
    if await svc.store.get(job_id, owner) is None:
        raise not_found(job_id)
    outcome = await svc.store.cancel(job_id)
    if outcome == "missing":
        raise not_found(job_id)
    rec = await svc.store.get(job_id, owner)
    if rec is None:
        raise not_found(job_id)
    if outcome == "finished" and rec.status != "cancelled":
        raise ApiError(409, "job_finished", f"job {job_id} already ended ({rec.status})",
                       status=rec.status)
    if outcome == "cancelled" and rec.callback_url is not None:
        # Ended here, not by a worker: its webhook is queued here. A queue that is down
        # loses that webhook but not the cancel.
        try:
            await run_in_threadpool(svc.enqueuer.enqueue_webhook, job_id)
        except Exception as exc:
            log.error("webhook of cancelled job %s not queued: %s", job_id, exc)
    return _job(rec, 202)


def _priority(asked: str | None, owner: str, settings: Settings) -> str:
    """The job's priority; 403 ``priority_not_allowed`` above the key's cap."""
    priority = asked or "normal"
    cap = settings.priority_cap(owner)
    if PRIORITIES.index(priority) > PRIORITIES.index(cap):
        raise ApiError(403, "priority_not_allowed",
                       f"key {owner} may submit at priority {cap} at most, not {priority}",
                       priority=priority, cap=cap)
    return priority


async def _own_outputs(auth: Caller, job_ids: set[str]) -> dict[str, Published]:
    """The outputs of those of ``job_ids`` that the caller may read as ``job:`` sources:
    looked up with the caller's key and only when succeeded, as the files route serves
    them. The others are left out, and a source naming one is ``source_not_found``
    whether the job is unknown, another key's or unfinished."""
    out: dict[str, Published] = {}
    for job_id in sorted(job_ids):
        rec = await auth.svc.store.get(job_id, auth.owner)
        found = (published(rec.status, rec.result_prefix, rec.result)
                 if rec is not None else None)
        if found is not None:
            out[job_id] = found
    return out


async def _check_quota(auth: Caller) -> None:
    """Refuse a submission while the key's published outputs fill its storage quota (a
    job that would go past it fails when publishing, with the same code)."""
    quota = auth.svc.settings.storage_quota_bytes_per_key
    if quota is None:
        return
    used = await auth.svc.store.usage(auth.owner)
    if used >= quota:
        raise ApiError(413, "quota_exceeded",
                       f"key {auth.owner} holds {used} bytes of outputs, its storage quota is "
                       f"{quota}; delete jobs (DELETE /v1/jobs/{{id}}) to free space",
                       used=used, quota=quota)


async def _set_pinned(job_id: str, auth: Auth, pinned: bool) -> Response:
    check_id(job_id)
    if not await auth.svc.store.pin(job_id, auth.owner, pinned):
        raise not_found(job_id)
    rec = await auth.svc.store.get(job_id, auth.owner)
    if rec is None:  # deleted in between
        raise not_found(job_id)
    return _job(rec)


@router.post("/{job_id}/pin", response_model=JobOut)
async def pin_job(job_id: str, auth: Auth) -> Response:
    """Keep the job and its outputs past the retention period (until unpinned or
    deleted). Idempotent."""
    return await _set_pinned(job_id, auth, True)


@router.post("/{job_id}/unpin", response_model=JobOut)
async def unpin_job(job_id: str, auth: Auth) -> Response:
    """Let the job expire again (at once, if it ended longer ago than the retention
    period: the next sweep removes it). Idempotent."""
    return await _set_pinned(job_id, auth, False)


@router.delete("/{job_id}", status_code=204, response_class=Response,
               responses={204: {"description": "deleted"}})
async def delete_job(job_id: str, auth: Auth) -> Response:
    """Delete a finished job: its published files, then nothing of it is left.

    404 for an unknown job, another key's, or one already deleted (so a retried delete
    whose first answer was lost gets 404); 409 ``job_active`` while it is queued or
    running: cancel it first. Files being downloaded at that moment end in an error
    for that download, never in a short file the client would accept."""
    owner, svc = auth.owner, auth.svc
    check_id(job_id)
    rec = await svc.store.get(job_id, owner)
    if rec is None:
        raise not_found(job_id)
    outcome, _ = await svc.store.remove(rec)
    if outcome == "missing":
        raise not_found(job_id)
    if outcome == "active":
        current = await svc.store.get(job_id, owner)
        status = current.status if current is not None else rec.status
        raise ApiError(409, "job_active",
                       f"job {job_id} is {status}; cancel it first "
                       f"(POST /v1/jobs/{job_id}/cancel), then delete it", status=status)
    # The record went atomically with queueing its prefix for deletion: if the store is
    # down now, the workers' heartbeat deletes the files once it answers.
    prefix = job_storage_prefix(job_id)
    try:
        await run_in_threadpool(svc.storage.delete_prefix, prefix)
    except StorageError as exc:
        log.warning("job %s deleted; its files are deleted later: %s", job_id, exc.message)
    else:
        await svc.store.outputs_deleted(prefix)
    log.info("job %s deleted by %s (%s)", job_id, owner, rec.status)
    return Response(status_code=204)
