"""Every parse of request text is bounded: numbers with thousands of digits, megabyte ids
and paths get a 4xx with a code (or, for a Range header, are ignored), never a 500."""

from __future__ import annotations

from typing import Any

import pytest

from app.api.routes.files import parse_range
from app.storage.local import LocalStorage
from tests.api.conftest import Api
from worker.runner import JobRunner

HUGE = "9" * 5000  # past Python's 4300-digit int() limit


def _problem(resp: Any, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body: dict[str, Any] = resp.json()
    assert set(body) == {"code", "message", "details"} and body["code"] == code, body
    assert len(resp.content) < 2000  # nothing long is echoed back
    return body


@pytest.mark.parametrize("header", [f"bytes={HUGE}-", f"bytes=-{HUGE}", f"bytes=0-{HUGE}",
                                    f"bytes={'0' * 5000}1-2", "bytes=0-1" + " " * 100],
                         ids=["start", "suffix", "end", "leading-zeros", "padded"])
def test_range_numbers_of_any_length_never_raise(header: str) -> None:
    assert parse_range(header, 100) is None  # ignored: the whole file is a valid answer


def test_range_within_bounds_still_parses() -> None:
    assert parse_range("bytes=" + "0" * 18 + "5-", 100) == (5, 99)
    assert parse_range("bytes=10-" + "9" * 19, 100) == (10, 99)
    assert parse_range("bytes=-" + "9" * 19, 100) == (0, 99)
    with pytest.raises(Exception, match="100 bytes"):
        parse_range("bytes=" + "9" * 19 + "-", 100)


def test_files_route_bounds_ranges_ids_and_paths(api: Api) -> None:
    jid = str(api.submit()["id"])
    runner = JobRunner(api.settings, api.worker_store(), LocalStorage(api.settings.storage_dir),
                       worker="test")
    assert runner.run(jid) == "succeeded"
    url = f"/v1/jobs/{jid}/files/model.safetensors"
    whole = api.client.get(url, headers=api.auth())
    assert whole.status_code == 200
    for rng in (f"bytes={HUGE}-", f"bytes=-{HUGE}", f"bytes=0-{HUGE}"):
        r = api.client.get(url, headers={**api.auth(), "Range": rng})
        assert r.status_code == 200 and r.content == whole.content, rng
    r = api.client.get(url, headers={**api.auth(), "Range": "bytes=" + "9" * 19 + "-"})
    _problem(r, 416, "range_not_satisfiable")
    body = _problem(api.client.get(f"/v1/jobs/{jid}/files/{'p' * 5000}", headers=api.auth()),
                    404, "file_not_found")
    assert len(body["details"]["path"]) < 300
    long_id = "j_" + "0" * 5000
    _problem(api.client.get(f"/v1/jobs/{long_id}", headers=api.auth()), 404, "job_not_found")
    _problem(api.client.get(f"/v1/jobs/{long_id}/files/model.safetensors",
                            headers=api.auth()), 404, "job_not_found")
    for action in ("cancel", "pin", "unpin"):
        _problem(api.client.post(f"/v1/jobs/{long_id}/{action}", headers=api.auth()), 404,
                 "job_not_found")
    _problem(api.client.delete(f"/v1/jobs/{long_id}", headers=api.auth()), 404,
             "job_not_found")
    _problem(api.client.get("/v1/jobs", params={"status": "s" * 5000}, headers=api.auth()),
             422, "invalid_request")
    _problem(api.client.get("/v1/jobs", params={"limit": HUGE}, headers=api.auth()),
             422, "invalid_request")


def test_declared_body_length_of_any_size_is_413(api: Api) -> None:
    r = api.client.post("/v1/jobs", json=api.named(),
                        headers={**api.auth(), "Content-Length": HUGE})
    _problem(r, 413, "request_too_large")


@pytest.mark.parametrize("size", [HUGE, "9" * 400 + "GB", "1e400GB", "1e308GB", 10**30,
                                  "x" * 5000, -5, "5 XB"],
                         ids=["digits", "digits-GB", "1e400", "1e308", "int", "text", "negative",
                              "unit"])
def test_shard_sizes_are_bounded(api: Api, size: object) -> None:
    r = api.client.post("/v1/jobs", json=api.named(shard_size=size), headers=api.auth())
    _problem(r, 422, "invalid_recipe")
    m = api.models
    recipe = {"merge_method": "linear", "out_shard_size": size,
              "models": [{"model": str(m.donor), "parameters": {"weight": 0.5}},
                         {"model": str(m.lang), "parameters": {"weight": 0.5}}]}
    _problem(api.client.post("/v1/jobs", json={"recipe": recipe}, headers=api.auth()),
             422, "invalid_recipe")


@pytest.mark.parametrize(("size", "bytes_"), [("5G", 5 * 10**9), ("512MiB", 512 * 2**20),
                                              ("1.5 GB", 15 * 10**8), (4096, 4096),
                                              ("20KB", 20_000)])
def test_shard_sizes_in_range_are_accepted(api: Api, size: object, bytes_: int) -> None:
    job = api.submit(api.named(shard_size=size))
    assert job["recipe"]["out_shard_size"] == bytes_
