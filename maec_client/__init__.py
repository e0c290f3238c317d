"""Python client for the maec merge service (torch-free; see docs/api.md)."""

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
from maec_client.models import FileInfo, Job, JobPage, JobResult, NamedJob, Progress

__all__ = [
    "ApiError", "AsyncClient", "AuthError", "ChecksumMismatch", "Client", "ClientConfig",
    "ClientError",
    "ConfigError", "Conflict", "DownloadError", "FileInfo", "Job", "JobCancelled",
    "JobFailed", "JobNotSucceeded", "JobPage", "JobResult", "NamedJob", "NetworkError",
    "NotFound", "Progress", "RangeNotSatisfiable", "RateLimited", "ServerError",
    "ValidationFailed", "WaitTimeout", "build_body", "resolve_config",
]
