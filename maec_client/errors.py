"""Typed client exceptions.

Every API failure carries the contract's stable ``code`` (docs/api.md, "Errors"), so
callers branch on ``exc.code`` or on the class, never on message text. The class is
chosen from the HTTP status family; the code says exactly what went wrong inside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from maec_client.models import Job


class ClientError(Exception):
    """Base of everything this package raises on purpose."""

    code: str = "client_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


class ConfigError(ClientError):
    """The client's configuration (flags, environment, config file) is invalid."""

    code = "invalid_config"


class ApiError(ClientError):
    """The service answered with an error body ``{code, message, details}``.

    ``retry_after``: seconds the service asked to wait (its ``Retry-After``), if it did.
    """

    def __init__(self, code: str, message: str, details: dict[str, Any] | None = None,
                 status: int = 0, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.details: dict[str, Any] = dict(details or {})
        self.status = status
        self.retry_after = retry_after

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "details": self.details,
                "status": self.status}


class AuthError(ApiError):
    """401: missing or unknown API key."""


class NotFound(ApiError):
    """404: ``job_not_found`` (also another key's job) or ``file_not_found``."""


class ValidationFailed(ApiError):
    """400/413/422: the request or recipe was refused before anything was queued."""


class Conflict(ApiError):
    """409: e.g. ``job_finished`` when cancelling a job that already ended."""


class RateLimited(ApiError):
    """429: ``rate_limited`` or ``too_many_jobs``; ``retry_after`` in seconds if sent."""

    def __init__(self, code: str, message: str, details: dict[str, Any] | None = None,
                 status: int = 429, retry_after: float | None = None) -> None:
        super().__init__(code, message, details, status, retry_after)


class RangeNotSatisfiable(ApiError):
    """416: a ranged download asked for bytes past the end of the file."""


class ServerError(ApiError):
    """5xx: ``unavailable`` (503, with ``retry_after``) or an unexpected server failure."""


class NetworkError(ClientError):
    """The service could not be reached or the connection broke (after retries)."""

    code = "network_error"


class JobFailed(ClientError):
    """``wait`` saw the job end as ``failed``; ``job.error`` has the worker's code."""

    def __init__(self, job: Job) -> None:
        err = job.error
        self.job = job
        self.code = err.code if err else "job_failed"
        self.details: dict[str, Any] = dict(err.details) if err else {}
        super().__init__(f"job {job.id} failed: {err.message if err else 'no error recorded'}")


class JobCancelled(ClientError):
    """``wait`` saw the job end as ``cancelled``."""

    code = "cancelled"

    def __init__(self, job: Job) -> None:
        self.job = job
        super().__init__(f"job {job.id} was cancelled")


class WaitTimeout(ClientError):
    """``wait`` gave up before the job finished; ``job`` is the last state seen."""

    code = "wait_timeout"

    def __init__(self, job: Job, timeout: float) -> None:
        self.job = job
        super().__init__(f"job {job.id} still {job.status} after {timeout:g} s")


class JobNotSucceeded(ClientError):
    """``download`` was asked for a job that has no result (not ``succeeded``)."""

    code = "job_not_succeeded"


class ChecksumMismatch(ClientError):
    """A downloaded file's sha256 (or size) differs from the manifest's."""

    code = "checksum_mismatch"

    def __init__(self, path: str, expected: str, actual: str) -> None:
        self.path = path
        self.expected = expected
        self.actual = actual
        super().__init__(f"{path}: expected sha256 {expected}, got {actual}")


class DownloadError(ClientError):
    """The download cannot proceed locally (target exists, unsafe path, foreign partial)."""

    code = "download_error"


# Status family -> class. Codes inside a family stay free to grow without a client change.
_BY_STATUS: dict[int, type[ApiError]] = {
    400: ValidationFailed, 401: AuthError, 403: AuthError, 404: NotFound, 409: Conflict,
    413: ValidationFailed, 416: RangeNotSatisfiable, 422: ValidationFailed,
}


def error_from_response(status: int, body: Any, retry_after: str | None = None) -> ApiError:
    """Build the typed error for a non-2xx answer; tolerates bodies off the contract."""
    if isinstance(body, dict) and isinstance(body.get("code"), str):
        code = str(body["code"])
        message = str(body.get("message") or code)
        details = body.get("details") if isinstance(body.get("details"), dict) else {}
    else:
        # A proxy or crash page rather than the service: keep the status visible in the code.
        code = f"http_{status}"
        message = body if isinstance(body, str) and body else f"HTTP {status}"
        details = {}
    if status == 429:
        return RateLimited(code, message, details, status, _parse_retry_after(retry_after))
    if status >= 500:
        return ServerError(code, message, details, status, _parse_retry_after(retry_after))
    cls = _BY_STATUS.get(status, ApiError)
    return cls(code, message, details, status)


def _parse_retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        # HTTP-date form: the service sends seconds, so we do not parse dates; caller backs off.
        return None
