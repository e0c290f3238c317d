from __future__ import annotations

import pytest

from maec_client.errors import (
    ApiError,
    AuthError,
    Conflict,
    NotFound,
    RangeNotSatisfiable,
    RateLimited,
    ServerError,
    ValidationFailed,
    error_from_response,
)


@pytest.mark.parametrize(("status", "code", "cls"), [
    (401, "unauthorized", AuthError),
    (404, "job_not_found", NotFound),
    (404, "file_not_found", NotFound),
    (422, "invalid_recipe", ValidationFailed),
    (422, "pickle_refused", ValidationFailed),
    (413, "request_too_large", ValidationFailed),
    (409, "job_finished", Conflict),
    (416, "range_not_satisfiable", RangeNotSatisfiable),
    (429, "too_many_jobs", RateLimited),
    (503, "unavailable", ServerError),
    (500, "internal_error", ServerError),
    (418, "teapot", ApiError),
])
def test_status_family_picks_class_and_code_is_kept(status, code, cls):
    exc = error_from_response(status, {"code": code, "message": "m", "details": {"a": 1}})
    assert type(exc) is cls
    assert (exc.code, exc.message, exc.details, exc.status) == (code, "m", {"a": 1}, status)
    assert str(exc) == f"[{code}] m"


def test_retry_after_seconds_parsed_and_date_form_ignored():
    body = {"code": "rate_limited", "message": "slow down", "details": {}}
    exc = error_from_response(429, body, "7")
    assert isinstance(exc, RateLimited) and exc.retry_after == 7.0
    exc = error_from_response(429, body, "Wed, 21 Oct 2015 07:28:00 GMT")
    assert isinstance(exc, RateLimited) and exc.retry_after is None


def test_body_off_contract_keeps_status_in_code():
    exc = error_from_response(502, "<html>bad gateway</html>")
    assert isinstance(exc, ServerError)
    assert exc.code == "http_502" and "bad gateway" in exc.message
    exc = error_from_response(404, {"detail": "Not Found"})  # FastAPI default shape
    assert isinstance(exc, NotFound) and exc.code == "http_404" and exc.details == {}
