"""Response models for OpenAPI: the job contract is maec_contract's (shared with the
client), the request model too (see app.submission); only the probes are service-only."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from maec_contract import ErrorBody, Job, JobPage

# The service's names for the contract models (routes and tests use these).
Problem = ErrorBody
JobOut = Job
JobList = JobPage


class Health(BaseModel):
    status: str


class Ready(BaseModel):
    redis: bool
    storage: bool
    workers: int


PROBLEMS: dict[int | str, dict[str, Any]] = {
    s: {"model": Problem} for s in (401, 404, 409, 413, 416, 422, 429, 503)
}
