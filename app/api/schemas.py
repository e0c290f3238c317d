"""Models for OpenAPI: the job contract is maec_contract's (shared with the client); the
job body the API validates is the typed one built from the merge methods
(``app.api.job_body``); the probes are service-only."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from app.api.job_body import JobBody as JobBody
from app.api.job_body import to_request as to_request
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


def _job_link(operation_id: str, job_id: str, **extra: str) -> dict[str, Any]:
    return {"operationId": operation_id, "parameters": {"job_id": job_id, **extra}}


# OpenAPI links from a submitted job to the operations on it, so clients (and the
# stateful fuzz tests) can follow a job's id. Operation ids are FastAPI's defaults.
_GET = "get_job_v1_jobs__job_id__get"
_CANCEL = "cancel_job_v1_jobs__job_id__cancel_post"
_FILE = "get_file_v1_jobs__job_id__files__path__get"
_FILES = "list_files_v1_jobs__job_id__files_get"
_PIN = "pin_job_v1_jobs__job_id__pin_post"
_DELETE = "delete_job_v1_jobs__job_id__delete"
SUBMIT_LINKS: dict[str, Any] = {
    "GetJob": _job_link(_GET, "$response.body#/id"),
    "CancelJob": _job_link(_CANCEL, "$response.body#/id"),
    "PinJob": _job_link(_PIN, "$response.body#/id"),
    "DeleteJob": _job_link(_DELETE, "$response.body#/id"),
    "ListFiles": _job_link(_FILES, "$response.body#/id"),
    "GetManifest": _job_link(_FILE, "$response.body#/id", path="manifest.json"),
}
LIST_LINKS: dict[str, Any] = {
    "GetFirstJob": _job_link(_GET, "$response.body#/jobs/0/id"),
}
