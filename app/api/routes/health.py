"""Health, readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from app.api.deps import Auth
from app.api.metrics import render_metrics
from app.api.schemas import Health, Ready

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
async def healthz() -> dict[str, str]:
    """The process is up (no dependencies checked; no key needed)."""
    return {"status": "ok"}


@router.get("/readyz", response_model=Ready, responses={503: {"model": Ready}})
async def readyz(auth: Auth) -> JSONResponse:
    """Redis and storage reachable and at least one worker heartbeating."""
    svc = auth.svc
    try:
        redis_ok = await asyncio.wait_for(svc.store.ping(), 2)
        workers = await svc.store.live_workers(3 * svc.settings.worker_heartbeat_seconds)
    except Exception:
        redis_ok, workers = False, 0
    try:
        storage_ok = await asyncio.wait_for(run_in_threadpool(svc.storage.ping), 5)
    except Exception:
        storage_ok = False
    body = {"redis": redis_ok, "storage": storage_ok, "workers": workers}
    ok = redis_ok and storage_ok and workers > 0
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics", response_class=Response)
async def metrics(auth: Auth) -> Response:
    """Prometheus text: jobs by status, durations, bytes published, live workers, and
    per pool (queued, active, workers) and per key (queued, running)."""
    return Response(await render_metrics(auth.svc.store, auth.svc.settings, auth.svc.queue),
                    media_type=CONTENT_TYPE_LATEST)
