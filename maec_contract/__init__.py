"""The merge service's REST contract (docs/api.md) as pydantic models, declared once.

The service validates requests and documents its responses with these models; the client
parses responses and builds requests with the same ones. Torch-free and dependency-light
(pydantic only), so it ships with the client distribution and the service imports it.
"""

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

__all__ = [
    "NAMED_FIELDS", "OTHER_KINDS", "STATUSES", "TERMINAL", "AnyJobRequest", "ErrorBody",
    "EvalTable", "Evaluation", "FileInfo", "FileList", "Job", "JobPage", "JobRequest",
    "JobResult", "JobStatus", "JobSubmission", "KindRequest", "LeaderboardRow",
    "MoeJobRequest", "NamedFields", "NamedJob", "PoolLoad", "Progress", "QueueCounts",
    "QueuePlace", "QueueSummary", "QueuedJob", "RecipeJob", "SweepSummary",
    "WebhookDelivery", "file_url", "parse_job_request", "request_kind", "with_file_urls",
]
