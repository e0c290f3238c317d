"""A job's file URLs are the API's: the stored record keeps its files without them, and
every answer that shows the job (its read, the list, the file list, the webhook body)
adds them; a record stored with URLs is served as it was stored."""

from __future__ import annotations

import json
from typing import Any

from app.jobs.keys import job_key
from app.webhooks.delivery import job_body
from maec_contract import Job
from tests.api.conftest import Api


def _stored_result(api: Api, jid: str) -> dict[str, Any]:
    raw = api.r.hget(job_key(jid), "result")
    assert isinstance(raw, bytes)
    return dict(json.loads(raw))


def _answers(api: Api, jid: str) -> dict[str, list[dict[str, Any]]]:
    """The files of job ``jid`` in each answer that shows them."""
    job = api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json()
    page = api.client.get("/v1/jobs", headers=api.auth()).json()
    listed = next(j for j in page["jobs"] if j["id"] == jid)
    files = api.client.get(f"/v1/jobs/{jid}/files", headers=api.auth()).json()
    rec = api.worker_store().get(jid)
    assert rec is not None
    hooked = json.loads(job_body(rec))
    # What the contract parses is what was sent.
    assert Job.model_validate(job).result is not None
    return {"job": job["result"]["files"], "list": listed["result"]["files"],
            "files": files["files"], "webhook": hooked["result"]["files"]}


def test_the_api_adds_file_urls_the_record_does_not_keep(api: Api) -> None:
    jid = str(api.submit()["id"])
    urls, _ = api.run_published(jid)
    stored = _stored_result(api, jid)["files"]
    assert stored and all("url" not in f for f in stored)
    for where, files in _answers(api, jid).items():
        assert [{k: v for k, v in f.items() if k != "url"} for f in files] == stored, where
        assert {f["path"]: f["url"] for f in files} == urls, where
        assert all(f["url"] == f"/v1/jobs/{jid}/files/{f['path']}" for f in files), where
    for path, url in urls.items():
        assert api.client.get(url, headers=api.auth()).status_code == 200, path


def test_a_record_stored_with_urls_is_served_as_stored(api: Api) -> None:
    jid = str(api.submit()["id"])
    api.run_published(jid)
    result = _stored_result(api, jid)
    # As the worker stored it before the API added URLs: an entry may name any URL,
    # and an empty one is filled in.
    old = [{**f, "url": f"https://elsewhere.example/{f['path']}"} for f in result["files"]]
    old[0]["url"] = ""
    api.r.hset(job_key(jid), "result",
               json.dumps({**result, "files": old}, separators=(",", ":")))
    for where, files in _answers(api, jid).items():
        assert files[0]["url"] == f"/v1/jobs/{jid}/files/{old[0]['path']}", where
        assert files[1:] == old[1:], where
