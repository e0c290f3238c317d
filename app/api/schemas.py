"""Response models (for OpenAPI and the client); the request model is app.submission's."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from app.jobs.record import Progress, Status


class Problem(BaseModel):
    code: str
    message: str
    details: dict[str, Any]


class FileOut(BaseModel):
    path: str
    size: int
    sha256: str
    url: str


class ResultOut(BaseModel):
    manifest: dict[str, Any]
    report: dict[str, Any]
    files: list[FileOut]
    core_seconds: float


class JobOut(BaseModel):
    id: str
    status: Status
    stage: str | None
    progress: Progress
    method: str
    name: str | None
    recipe: dict[str, Any]
    created_at: str
    started_at: str | None
    finished_at: str | None
    attempts: int
    cancel_requested: bool
    artifact_reused: bool | None
    error: Problem | None
    result: ResultOut | None


class JobList(BaseModel):
    jobs: list[JobOut]
    next_cursor: str | None


class Health(BaseModel):
    status: str


class Ready(BaseModel):
    redis: bool
    storage: bool
    workers: int


PROBLEMS: dict[int | str, dict[str, Any]] = {
    s: {"model": Problem} for s in (401, 404, 409, 413, 416, 422, 429, 503)
}
