"""Python client for the maec merge service (torch-free; see docs/api.md).

Its own distribution (maec_client/pyproject.toml): httpx, pydantic, click and tqdm, plus
maec_contract, the REST contract's models that the service imports too.
"""

from maec_client.aio import AsyncClient
from maec_client.client import Client, build_body
from maec_client.config import ClientConfig, ConfigError, resolve_config
from maec_client.errors import (
    ApiError,
    AuthError,
    ChecksumMismatch,
    ClientError,
    Conflict,
    DownloadError,
    JobCancelled,
    JobFailed,
    JobNotSucceeded,
    NetworkError,
    NotFound,
    RangeNotSatisfiable,
    RateLimited,
    ServerError,
    ValidationFailed,
    WaitTimeout,
)
from maec_client.models import (
    FileInfo,
    Job,
    JobPage,
    JobRequest,
    JobResult,
    NamedJob,
    Progress,
    RecipeJob,
)
from maec_client.retry import RetryPolicy

__all__ = [
    "ApiError", "AsyncClient", "AuthError", "ChecksumMismatch", "Client", "ClientConfig",
    "ClientError",
    "ConfigError", "Conflict", "DownloadError", "FileInfo", "Job", "JobCancelled",
    "JobFailed", "JobNotSucceeded", "JobPage", "JobRequest", "JobResult", "NamedJob",
    "NetworkError", "NotFound", "Progress", "RangeNotSatisfiable", "RateLimited",
    "RecipeJob", "RetryPolicy", "ServerError", "ValidationFailed", "WaitTimeout",
    "build_body", "resolve_config",
]
