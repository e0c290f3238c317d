"""Every error body is ``{code, message, details}`` (docs/api.md), whatever raised it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api.job_body import describe_errors
from maec_core.service import MaecError

log = logging.getLogger("maec.api")


class ApiError(MaecError):
    """An HTTP-level failure with a contract code (401, 404, 409, 413, 416, 429, 503)."""

    def __init__(self, http_status: int, code: str, message: str,
                 headers: dict[str, str] | None = None, **details: Any) -> None:
        super().__init__(message, **details)
        self.http_status = http_status
        self.code = code
        self.headers = headers or {}


# The HTTP status each error code answers with. An error whose own code is not listed
# answers like its nearest base class that is (a new checkpoint error is a 422 without
# an entry here); the library itself knows nothing of HTTP.
STATUS_BY_CODE: dict[str, int] = {
    "merge_error": 400,
    # A body (or the record made from it) the schema or the store refuses.
    "invalid_request": 422,
    "invalid_recipe": 422,
    "invalid_source": 422,
    "invalid_checkpoint": 422,
    "invalid_tokenizer": 422,
    "non_finite_output": 422,
    "artifact_mismatch": 422,
    "invalid_corpus": 422,
    "invalid_eval_set": 422, "no_feasible_candidate": 422,
    "invalid_callback": 422,
    # No configured worker pool can hold the job (app/scheduler/pools.py).
    "no_capable_worker": 422,
    "output_exists": 409,
    # A stored record that cannot be sent as strict JSON (app/jobs/api_store.py).
    "job_unreadable": 409,
    "cancelled": 409,
    "storage_unavailable": 503,
}


def http_status(exc: MaecError) -> int:
    """The HTTP status of ``exc`` (an ``ApiError`` carries its own)."""
    if isinstance(exc, ApiError):
        return exc.http_status
    for cls in type(exc).__mro__:
        code = getattr(cls, "code", None)
        if isinstance(code, str) and code in STATUS_BY_CODE:
            return STATUS_BY_CODE[code]
    return STATUS_BY_CODE["merge_error"]


def problem(status: int, code: str, message: str, details: dict[str, Any] | None = None,
            headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"code": code, "message": message, "details": details or {}},
                        status_code=status, headers=headers)


async def _maec_error(_req: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, MaecError)
    headers = exc.headers if isinstance(exc, ApiError) else None
    return problem(http_status(exc), exc.code, exc.message, exc.details, headers)


def validation_problems(errs: Sequence[Any]) -> tuple[str, str, list[str]]:
    """``(code, message, problems)`` for pydantic errors of a job body, so every face of
    the service (the REST API, the /ui form) words them alike. A parameter or recipe
    problem is ``invalid_recipe``, as the methods' own checks call it; anything else the
    schema refuses is ``invalid_request``."""
    code, problems = describe_errors(errs)
    what = "invalid recipe" if code == "invalid_recipe" else "invalid request"
    return code, f"{what}: " + "; ".join(problems), problems


async def _validation(_req: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    code, message, problems = validation_problems(exc.errors())
    return problem(422, code, message, {"problems": problems})


async def _http(_req: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 400:
        # A body FastAPI cannot parse (malformed JSON, bad encoding) is the contract's
        # invalid_request 422, like any other schema violation; 400 is not documented.
        return problem(422, "invalid_request", f"invalid request: {exc.detail}")
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return problem(exc.status_code, code, str(exc.detail))


async def _redis_down(_req: Request, exc: Exception) -> JSONResponse:
    log.error("redis unavailable: %s", exc)
    return problem(503, "unavailable", "the job store is unreachable; retry later",
                   headers={"Retry-After": "5"})


async def _unexpected(_req: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return problem(500, "internal_error", "internal error (logged on the server)")


def install(app: FastAPI) -> None:
    app.add_exception_handler(MaecError, _maec_error)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(RedisConnectionError, _redis_down)
    app.add_exception_handler(RedisTimeoutError, _redis_down)
    app.add_exception_handler(Exception, _unexpected)
