"""/v1/queue: the caller's place in the fair-share queue and every pool's load."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from app.api.deps import Auth
from app.api.schemas import PROBLEMS
from maec_contract import QueueSummary

router = APIRouter(prefix="/v1/queue", tags=["queue"], responses=PROBLEMS)


@router.get("", response_model=QueueSummary)
async def queue_summary(auth: Auth) -> JSONResponse:
    """The caller's jobs (queued and running counts, each queued job's position and
    ETA) and each pool's depth, active jobs and live workers. Never another key's jobs:
    pools are counted, not listed."""
    summary = await auth.svc.queue.summary(auth.owner)
    return JSONResponse(summary.model_dump(mode="json"))
