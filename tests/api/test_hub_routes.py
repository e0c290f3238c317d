"""The Hub-compatible routes (app/api/routes/hub.py) over a job run in-process: what the
Hub client reads from them, and the files route's key, ownership and path rules."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from tests.api.conftest import Api

MODEL = "model.safetensors"


def _finished(api: Api) -> tuple[str, dict[str, dict[str, Any]], str]:
    """A succeeded job of alice's: its id, its published files by path, its commit id."""
    jid = str(api.submit()["id"])
    api.run_published(jid)
    files = api.client.get(f"/v1/jobs/{jid}/files", headers=api.auth()).json()["files"]
    by_path = {f["path"]: f for f in files}
    return jid, by_path, by_path["manifest.json"]["sha256"][:40]


def _routes(jid: str, rev: str = "main", path: str = MODEL) -> list[tuple[str, str]]:
    """Every Hub route for job ``jid``, as (method, URL)."""
    return [("GET", f"/api/models/jobs/{jid}"),
            ("GET", f"/api/models/jobs/{jid}/revision/{rev}"),
            ("GET", f"/api/models/jobs/{jid}/tree/{rev}"),
            ("GET", f"/api/models/jobs/{jid}/tree/{rev}/sub"),
            ("GET", f"/jobs/{jid}/resolve/{rev}/{path}"),
            ("HEAD", f"/jobs/{jid}/resolve/{rev}/{path}")]


def test_model_info_tree_and_resolve_answer_as_the_hub(api: Api) -> None:
    jid, files, commit = _finished(api)
    for rev in ("main", commit):
        r = api.client.get(f"/api/models/jobs/{jid}/revision/{rev}", headers=api.auth())
        assert r.status_code == 200 and r.headers["x-repo-commit"] == commit
        info = r.json()
        assert info["id"] == f"jobs/{jid}" and info["sha"] == commit
        assert {s["rfilename"]: (s["size"], s["lfs"]["sha256"]) for s in info["siblings"]} \
            == {p: (f["size"], f["sha256"]) for p, f in files.items()}
    assert api.client.get(f"/api/models/jobs/{jid}", headers=api.auth()).json() == info
    tree = api.client.get(f"/api/models/jobs/{jid}/tree/{commit}?recursive=true",
                          headers=api.auth()).json()
    assert {t["path"]: t["lfs"]["oid"] for t in tree} == {p: f["sha256"] for p, f in files.items()}
    assert all(t["type"] == "file" and len(t["oid"]) == 40 for t in tree)
    whole = api.client.get(f"/v1/jobs/{jid}/files/{MODEL}", headers=api.auth()).content
    head = api.client.head(f"/jobs/{jid}/resolve/main/{MODEL}", headers=api.auth())
    assert head.status_code == 200 and head.content == b""
    assert head.headers["etag"] == head.headers["x-linked-etag"] == f'"{files[MODEL]["sha256"]}"'
    assert head.headers["x-repo-commit"] == commit
    assert int(head.headers["content-length"]) == len(whole) == files[MODEL]["size"]
    got = api.client.get(f"/jobs/{jid}/resolve/{commit}/{MODEL}", headers=api.auth())
    assert got.status_code == 200 and got.content == whole
    part = api.client.get(f"/jobs/{jid}/resolve/main/{MODEL}",
                          headers={**api.auth(), "Range": "bytes=100-"})
    assert part.status_code == 206 and part.content == whole[100:]
    assert part.headers["content-range"] == f"bytes 100-{len(whole) - 1}/{len(whole)}"
    assert hashlib.sha256(got.content).hexdigest() == files[MODEL]["sha256"]


def test_revisions_and_files_it_lacks_are_the_hubs_not_found(api: Api) -> None:
    jid, _, commit = _finished(api)
    for rev in ("v1", commit[:39] + "0", "refs%2Fpr%2F1"):
        for method, url in _routes(jid, rev)[1:]:
            r = api.client.request(method, url, headers=api.auth())
            assert r.status_code == 404, (method, url)
            assert r.headers["x-error-code"] == "RevisionNotFound", (method, url)
    for path in ("nope.bin", "..%2Fmanifest.json", "%2Fetc%2Fpasswd", "sub%2F..%2F" + MODEL,
                 "x" * 5000):
        r = api.client.get(f"/jobs/{jid}/resolve/main/{path}", headers=api.auth())
        assert r.status_code == 404 and r.json()["code"] == "file_not_found", path
        assert r.headers["x-error-code"] == "EntryNotFound"
        # The client records a file's absence at this commit.
        assert r.headers["x-repo-commit"] == commit


def test_another_keys_unknown_and_unfinished_jobs_are_not_found_on_every_route(
        api: Api) -> None:
    jid, _, commit = _finished(api)
    queued = str(api.submit()["id"])
    for key, job, code in (("bob", jid, "job_not_found"), ("alice", "j-nope", "job_not_found"),
                           ("alice", queued, "model_not_ready")):
        for rev in ("main", commit):
            for method, url in _routes(job, rev):
                r = api.client.request(method, url, headers=api.auth(key))
                assert r.status_code == 404, (key, method, url)
                assert r.headers["x-error-code"] == "RepoNotFound", (key, method, url)
                if method == "GET":
                    assert r.json()["code"] == code
                    assert r.text.count(commit) == 0, "nothing of the job leaks"


def test_keys_are_checked_as_on_the_files_route(api_factory: Callable[..., Api]) -> None:
    # Room for the 30 failures below before the per-address 429 (which applies too).
    api = api_factory(auth_failure_burst=100)
    jid, _, _ = _finished(api)
    key = api.auth()["Authorization"].split(" ")[1]
    for method, url in _routes(jid):
        for bad in ("Bearer nope", f"Bearer {key}x"):
            wrong = api.client.request(method, url, headers={"Authorization": bad})
            assert wrong.status_code == 401, url
            assert wrong.headers["x-error-message"] == \
                "Invalid credentials in Authorization header"
            assert bad.split(" ")[1] not in str(wrong.headers) + wrong.text
        for absent in ({}, {"Authorization": f"Basic {key}"}, {"X-Api-Key": key}):
            none = api.client.request(method, url, headers=absent)
            assert none.status_code == 401 and none.headers["x-error-code"] == "RepoNotFound"
            assert none.headers["www-authenticate"] == "Bearer"
