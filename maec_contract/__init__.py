"""The merge service's REST contract (docs/api.md) as pydantic models, declared once.

The service validates requests and documents its responses with these models; the client
parses responses and builds requests with the same ones. Torch-free and dependency-light
(pydantic only), so it ships with the client distribution and the service imports it.

The response models (:mod:`~maec_contract.jobs`) are imported on first use of one of
their names: the merge library needs only the request models (``maec merge`` starts
without the others).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from maec_contract.requests import (
    NAMED_FIELDS,
    OTHER_KINDS,
    AnyJobRequest,
    JobRequest,
    JobSubmission,
    KindRequest,
    MoeJobRequest,
    NamedFields,
    NamedJob,
    RecipeJob,
    parse_job_request,
    request_kind,
)

if TYPE_CHECKING:
    from maec_contract.jobs import (
        STATUSES,
        TERMINAL,
        ErrorBody,
        EvalTable,
        Evaluation,
        FileInfo,
        FileList,
        Job,
        JobPage,
        JobResult,
        JobStatus,
        LeaderboardRow,
        PoolLoad,
        Progress,
        QueueCounts,
        QueuedJob,
        QueuePlace,
        QueueSummary,
        SweepSummary,
        WebhookDelivery,
        file_url,
        with_file_urls,
    )

# The names of :mod:`maec_contract.jobs` this package answers for (``__getattr__``).
_JOBS = frozenset({
    "STATUSES", "TERMINAL", "ErrorBody", "EvalTable", "Evaluation", "FileInfo", "FileList",
    "Job", "JobPage", "JobResult", "JobStatus", "LeaderboardRow", "PoolLoad", "Progress",
    "QueueCounts", "QueuedJob", "QueuePlace", "QueueSummary", "SweepSummary",
    "WebhookDelivery", "file_url", "with_file_urls",
})

__all__ = [
    "NAMED_FIELDS", "OTHER_KINDS", "STATUSES", "TERMINAL", "AnyJobRequest", "ErrorBody",
    "EvalTable", "Evaluation", "FileInfo", "FileList", "Job", "JobPage", "JobRequest",
    "JobResult", "JobStatus", "JobSubmission", "KindRequest", "LeaderboardRow",
    "MoeJobRequest", "NamedFields", "NamedJob", "PoolLoad", "Progress", "QueueCounts",
    "QueuePlace", "QueueSummary", "QueuedJob", "RecipeJob", "SweepSummary",
    "WebhookDelivery", "file_url", "parse_job_request", "request_kind", "with_file_urls",
]


def __getattr__(name: str) -> Any:
    """A response model's name, imported from :mod:`maec_contract.jobs` on first use
    and kept here after it."""
    if name not in _JOBS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("maec_contract.jobs"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_JOBS})
