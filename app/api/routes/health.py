"""Health, readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from app.api.deps import Auth, Operator
from app.api.metrics import render_metrics
from app.api.schemas import Health, Problem, Ready

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


@router.get("/metrics", response_class=Response, responses={
    403: {"model": Problem, "description": "an API key, not the operator's metrics token "
          "(`operator_only`)"},
})
async def metrics(svc: Operator) -> Response:
    """Prometheus text for the operator (bearer `MAEC_METRICS_TOKEN_SHA256`'s token; API
    keys get 403): jobs by status, durations, bytes published, live workers, per pool
    (queued, active, workers), and per key (queued, running) only with
    `MAEC_METRICS_PER_KEY`."""
    return Response(await render_metrics(svc.store, svc.settings, svc.queue),
                    media_type=CONTENT_TYPE_LATEST)
