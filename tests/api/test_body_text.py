"""Text and nesting a job body may not carry, refused before any job exists; a record
that cannot be sent is never stored; and one already stored (written directly here, as
a service without these checks stored it) cannot take its key's job list down."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from app.api.bounds import MAX_BODY_DEPTH, BodyProblem, check_body
from app.jobs import calls
from app.jobs.api_store import DEGRADED_WARNING, ApiJobStore
from app.jobs.keys import job_key
from app.jobs.record import JobRecord, UnstorableRecord, new_job_id, now_iso
from app.queue import QUEUE
from tests.api.conftest import Api
from tests.conformance.moe_suite import A, B
from tests.hostile import (
    LONE_SURROGATE,
    deep_bodies,
    nested,
    raw_surrogate_body,
    surrogate_bodies,
)
from tests.hostile import MAX_BODY_DEPTH as DOCUMENTED_DEPTH
from tests.ui.test_pages import _login


def _bodies(api: Api) -> dict[str, dict[str, Any]]:
    """One body of each form, each with the free-form places it has filled in."""
    m = api.models
    return {
        "named": {"method": "ties", "base": str(m.base), "ability_donor": [str(m.donor)],
                  "language_base": str(m.lang), "name": "n", "idempotency_key": "k",
                  "parameters": {"density": 0.5, "not_a_parameter": {"free": ["form"]}},
                  "evaluate": [{"name": "e", "path": str(m.base), "extra": {"a": "b"}}],
                  "sweep": {"grid": {"density": [0.3, 0.5]}}},
        "recipe": {"recipe": {
            "merge_method": "ties", "base_model": str(m.base), "name": "r",
            "models": [{"model": str(m.donor), "parameters": {
                "weight": [{"filter": "mlp", "value": [0.1, 0.2]}, {"value": 1.0}]}}],
            "parameters": {"density": 0.5, "unread": {"k": "v"}}}},
        "moe": {"kind": "moe", "name": "m", "recipe": {
            "base_model": str(m.base), "gate_mode": "hidden", "unread_key": {"k": ["v"]},
            "experts": [{"source_model": str(m.donor), "positive_prompts": A,
                         "negative_prompts": ["not this"], "unread": "x"},
                        {"source_model": str(m.lang), "positive_prompts": B}]}},
    }


def _post(api: Api, raw: bytes) -> Any:
    return api.client.post("/v1/jobs", content=raw, headers={
        **api.auth(), "content-type": "application/json"})


def _no_job_exists(api: Api) -> None:
    listed = api.client.get("/v1/jobs", headers=api.auth())
    assert listed.status_code == 200 and listed.json()["jobs"] == [], listed.text
    assert api.r.llen(QUEUE) == 0
    assert not api.r.keys(job_key("*"))


def _refused(resp: Any, what: str) -> None:
    assert resp.status_code == 422, resp.text
    body = resp.json()
    assert body["code"] == "invalid_request", body
    assert what in body["message"], body
    resp.content.decode("utf-8")  # the answer itself is strict UTF-8


def test_the_documented_depth_is_the_one_enforced() -> None:
    assert MAX_BODY_DEPTH == DOCUMENTED_DEPTH
    check_body({"a": nested(MAX_BODY_DEPTH - 1)})
    with pytest.raises(BodyProblem, match="deeper than"):
        check_body({"a": nested(MAX_BODY_DEPTH)})
    # Iterative: a body far deeper than the interpreter's recursion limit is just refused.
    with pytest.raises(BodyProblem, match="deeper than"):
        check_body(nested(100_000))


@pytest.mark.parametrize("form", ["named", "recipe", "moe"])
def test_a_lone_surrogate_anywhere_is_refused_before_the_job_exists(api: Api,
                                                                    form: str) -> None:
    cases = surrogate_bodies(_bodies(api)[form])
    assert len(cases) > 10
    for where, body in cases:
        resp = _post(api, json.dumps(body).encode())  # the escape: "\ud800"
        assert resp.status_code == 422, (where, resp.text)
        _refused(resp, "lone UTF-16 surrogate")
    # The same character as raw UTF-8 bytes (which Python's JSON reader also accepts).
    strings = [p for p, v in _walk_strings(_bodies(api)[form])]
    for path in strings:
        _refused(_post(api, raw_surrogate_body(_bodies(api)[form], path)),
                 "lone UTF-16 surrogate")
    _no_job_exists(api)


def _walk_strings(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], str]]:
    if isinstance(doc, str):
        return [(path, doc)]
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(
        doc, list) else ()
    return [x for k, v in items for x in _walk_strings(v, (*path, k))]


@pytest.mark.parametrize("form", ["named", "recipe", "moe"])
def test_deep_nesting_anywhere_is_refused_before_the_job_exists(api: Api, form: str) -> None:
    for levels in (MAX_BODY_DEPTH, 300):
        for where, body in deep_bodies(_bodies(api)[form], levels):
            resp = _post(api, json.dumps(body).encode())
            assert resp.status_code == 422, (where, levels, resp.text)
            _refused(resp, f"nested deeper than {MAX_BODY_DEPTH} levels")
    _no_job_exists(api)


def test_an_moe_extra_key_nested_to_the_bound_is_accepted_and_one_more_refused(
        api: Api) -> None:
    body = _bodies(api)["moe"]
    # The body is level 1, the recipe level 2: the extra value's containers fill the rest.
    at_bound = {**body, "recipe": {**body["recipe"],
                                   "extra": nested(MAX_BODY_DEPTH - 2)}}
    resp = _post(api, json.dumps(at_bound).encode())
    assert resp.status_code == 202, resp.text
    assert any(w.startswith("extra") for w in resp.json()["warnings"]), resp.json()
    over = {**body, "recipe": {**body["recipe"], "extra": nested(MAX_BODY_DEPTH - 1)}}
    _refused(_post(api, json.dumps(over).encode()), "nested deeper than")


def _record(**kw: Any) -> JobRecord:
    return JobRecord(id=new_job_id(), owner="alice", method="moe", created_at=now_iso(),
                     **{"recipe": {}, **kw})


@pytest.mark.parametrize("record", [
    _record(name="a" + LONE_SURROGATE),
    _record(recipe={"experts": [{"positive_prompts": ["x" + LONE_SURROGATE]}]}),
    _record(recipe={"k" + LONE_SURROGATE: 1}),
    _record(recipe={"deep": nested(300)}),
    _record(estimate={"disk_bytes": float("nan")}),
], ids=["name", "prompt", "key", "deep", "nan"])
def test_the_store_refuses_a_record_it_could_not_send(api: Api, record: JobRecord) -> None:
    with pytest.raises(UnstorableRecord) as err:
        calls.create(record, max_active=10, weights={}, credit=0)
    assert err.value.code == "invalid_request"

    async def create() -> None:
        s = ApiJobStore.from_url(api.settings.redis_url)
        try:
            await s.create(record, max_active=10, weights={})
        finally:
            await s.close()

    with pytest.raises(UnstorableRecord):
        asyncio.run(create())
    assert not api.r.exists(job_key(record.id))


@pytest.mark.parametrize("stored", [
    b'{"name":"x\\ud800y"}',  # a lone surrogate, as json.dumps escapes it
    b'{"name":"x\xed\xa0\x80y"}',  # the same as raw bytes
    b'{"name":"x\xffy"}',  # not UTF-8 at all
], ids=["escaped-surrogate", "raw-surrogate", "not-utf8"])
def test_a_stored_record_that_cannot_be_sent_leaves_the_list_answering(
        api: Api, stored: bytes) -> None:
    bad = str(api.submit()["id"])
    good = str(api.submit(api.named(name="fine \U0001F600"))["id"])
    api.r.hset(job_key(bad), "recipe", stored)  # type: ignore[arg-type]
    listed = api.client.get("/v1/jobs", headers=api.auth())
    assert listed.status_code == 200, listed.text
    jobs = {j["id"]: j for j in json.loads(listed.content.decode("utf-8"))["jobs"]}
    assert set(jobs) == {bad, good}
    assert jobs[good]["name"] == "fine \U0001F600" and DEGRADED_WARNING not in jobs[good][
        "warnings"]
    assert jobs[bad]["warnings"][-1] == DEGRADED_WARNING
    assert jobs[bad]["status"] == "queued" and jobs[bad]["method"] == "task_arithmetic"
    # U+FFFD where the character was (one per byte that is not UTF-8).
    name = jobs[bad]["recipe"]["name"]
    assert name[0] == "x" and name[-1] == "y" and set(name[1:-1]) == {"\ufffd"}, name
    # Filtered pages read the same way.
    queued = api.client.get("/v1/jobs", params={"status": "queued"}, headers=api.auth())
    assert queued.status_code == 200 and len(queued.json()["jobs"]) == 2
    one = api.client.get(f"/v1/jobs/{bad}", headers=api.auth())
    assert one.status_code == 409, one.text
    assert one.json()["code"] == "job_unreadable"
    assert api.client.get(f"/v1/jobs/{good}", headers=api.auth()).status_code == 200
    # The pages show it degraded too.
    _login(api)
    assert api.client.get("/ui/jobs").status_code == 200
    page = api.client.get(f"/ui/jobs/{bad}")
    assert page.status_code == 200 and bad in page.text
    assert api.client.get(f"/ui/jobs/{bad}/state").status_code == 200
    # The job can still be managed: cancelled (answered in its degraded form), deleted.
    cancelled = api.client.post(f"/v1/jobs/{bad}/cancel", headers=api.auth())
    assert cancelled.status_code == 202, cancelled.text
    assert cancelled.json()["status"] == "cancelled"
    pinned = api.client.post(f"/v1/jobs/{bad}/pin", headers=api.auth())
    assert pinned.status_code == 200 and pinned.json()["pinned"] is True, pinned.text
    assert api.client.delete(f"/v1/jobs/{bad}", headers=api.auth()).status_code == 204
    left = api.client.get("/v1/jobs", headers=api.auth()).json()["jobs"]
    assert [j["id"] for j in left] == [good]
