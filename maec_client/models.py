"""The REST contract's shapes (docs/api.md), as the client reads and sends them.

Declared once in maec_contract, which the service uses too; re-exported here under the
client's names. Responses parse leniently (a newer service may add fields or statuses);
request bodies are strict, so a typo in a caller's kwargs fails here rather than as a 422
round trip.
"""

from __future__ import annotations

from maec_contract import (
    TERMINAL,
    ErrorBody,
    FileInfo,
    Job,
    JobPage,
    JobRequest,
    JobResult,
    JobStatus,
    JobSubmission,
    MoeJobRequest,
    NamedJob,
    Progress,
    QueueSummary,
    RecipeJob,
)

# A failed job's ``error`` is the same shape as an error answer's body.
JobErrorInfo = ErrorBody

__all__ = [
    "TERMINAL", "ErrorBody", "FileInfo", "Job", "JobErrorInfo", "JobPage", "JobRequest",
    "JobResult", "JobStatus", "JobSubmission", "MoeJobRequest", "NamedJob", "Progress",
    "QueueSummary", "RecipeJob",
]
