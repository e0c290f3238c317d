"""Python client for the maec merge service (torch-free; see docs/api.md).

Its own distribution (maec_client/pyproject.toml): httpx, pydantic, click and tqdm, plus
maec_contract, the REST contract's models that the service imports too.

The names below are imported on first use (PEP 562): the ``maec`` script is this
package's, and ``maec merge`` must not pay for httpx, pydantic-settings and the contract
models (about 0.2 s of CPU at every start) before handing over to the merge library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from maec_client.aio import AsyncClient
    from maec_client.client import Client, build_body
    from maec_client.config import ClientConfig, resolve_config
    from maec_client.errors import (
        ApiError,
        AuthError,
        ChecksumMismatch,
        ClientError,
        ConfigError,
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
        QueueSummary,
        RecipeJob,
    )
    from maec_client.retry import RetryPolicy

# Public name -> the module that defines it.
_HOMES: dict[str, str] = {
    "AsyncClient": "aio",
    "Client": "client", "build_body": "client",
    "ClientConfig": "config", "resolve_config": "config",
    **{name: "errors" for name in (
        "ApiError", "AuthError", "ChecksumMismatch", "ClientError", "ConfigError", "Conflict",
        "DownloadError", "JobCancelled", "JobFailed", "JobNotSucceeded", "NetworkError",
        "NotFound", "RangeNotSatisfiable", "RateLimited", "ServerError", "ValidationFailed",
        "WaitTimeout")},
    **{name: "models" for name in (
        "FileInfo", "Job", "JobPage", "JobRequest", "JobResult", "NamedJob", "Progress",
        "QueueSummary", "RecipeJob")},
    "RetryPolicy": "retry",
}

__all__ = [
    "ApiError", "AsyncClient", "AuthError", "ChecksumMismatch", "Client", "ClientConfig",
    "ClientError",
    "ConfigError", "Conflict", "DownloadError", "FileInfo", "Job", "JobCancelled",
    "JobFailed", "JobNotSucceeded", "JobPage", "JobRequest", "JobResult", "NamedJob",
    "NetworkError", "NotFound", "Progress", "QueueSummary", "RangeNotSatisfiable",
    "RateLimited",
    "RecipeJob", "RetryPolicy", "ServerError", "ValidationFailed", "WaitTimeout",
    "build_body", "resolve_config",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
