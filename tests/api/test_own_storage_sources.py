"""The service's own storage is never a source, as a hostile key would try it: every
spelling of the service's bucket and of its local directories, in every input role, is
refused before anything is queued; ``job:<id>`` reads a key's own succeeded job and
answers another key's, or an unknown one, as a missing source; ``s3://`` on a service
with local storage is a 422, never a 503; and ``artifact_reused`` never tells one key
that another ran the same extraction."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.jobs.keys import job_key
from app.jobs.record import decode
from app.queue import QUEUE
from app.settings import Settings, hash_key
from app.sources import SourceForbidden, parse_source, pin_source
from app.storage.local import LocalStorage
from app.storage.s3 import S3Storage
from maec_core.errors import SourceError
from tests import hostile
from tests.api.conftest import Api
from tests.conftest import TinyModels
from worker.runner import JobRunner

UNKNOWN = "j_000000000000deadbeef0000"
# A hostile key tries dozens of bodies in a row.
HIGH = {"submissions_per_minute": 100000, "rate_limit_per_minute": 100000,
        "rate_limit_burst": 10000}


@pytest.fixture
def api(api_factory: Any) -> Api:
    return api_factory(**HIGH)  # type: ignore[no-any-return]


def _s3_settings(tmp_path: Path) -> Settings:
    return Settings(api_keys={"a": hash_key("a")}, storage_backend="s3",
                    s3_bucket="maec-svc", s3_endpoint_url="http://objects.internal:9000",
                    s3_public_endpoint_url="https://dl.example.com",
                    s3_access_key="test-access", s3_secret_key="test-secret-value",
                    storage_dir=tmp_path / "storage", work_dir=tmp_path / "work")


def test_every_spelling_of_the_service_bucket_is_refused(tmp_path: Path) -> None:
    settings = _s3_settings(tmp_path)
    spellings = [*hostile.service_bucket_spellings("maec-svc", UNKNOWN, "objects.internal"),
                 hostile.Spelling("public_host", f"s3://maec-svc.dl.example.com/jobs/{UNKNOWN}",
                                  "source_forbidden"),
                 # Not a job's prefix, but the service's bucket all the same.
                 hostile.Spelling("innocent_key", "s3://maec-svc/models/base",
                                  "source_forbidden")]
    for case in spellings:
        with pytest.raises(SourceError) as err:
            parse_source(case.source, settings)
        assert err.value.code == case.code, (case.name, err.value.message)
        if case.code == "source_forbidden":
            assert isinstance(err.value, SourceForbidden)
    # Another bucket of the same store is a source as before.
    assert parse_source(f"s3://team-models/jobs/{UNKNOWN}/a1", settings).bucket == "team-models"


@pytest.mark.parametrize("code", ["AccessDenied", "403"])
def test_a_bucket_the_store_refuses_is_the_requests_error(tmp_path: Path, code: str) -> None:
    from botocore.stub import Stubber

    settings = _s3_settings(tmp_path)
    storage = S3Storage.from_settings(settings)
    with Stubber(storage.client) as stub:
        stub.add_client_error("head_object", service_error_code=code,
                              http_status_code=403)
        stub.add_client_error("list_objects_v2", service_error_code=code,
                              http_status_code=403)
        # An eval set or corpus (one object), then a checkpoint folder: asking again
        # would be refused again, so neither is a storage_unavailable (503).
        for uri, single in (("s3://locked/evals/set.jsonl", True),
                            ("s3://locked/models/base", False)):
            with pytest.raises(SourceError) as err:
                pin_source(parse_source(uri, settings), storage, single=single)
            assert err.value.code == "invalid_source", err.value.message
            assert "does not let this service read it" in err.value.message


def _qa_set(api: Api) -> str:
    qa = api.root / "extra" / "qa.jsonl"
    qa.write_text(json.dumps({"question": "w1 w2", "answer": "3"}) + "\n")
    return str(qa)


def _roles(api: Api, src: str) -> dict[str, dict[str, Any]]:
    m = api.models
    return hostile.in_every_role(src, str(m.base), str(m.donor), str(m.lang), _qa_set(api))


def _refusals(api: Api, src: str, key: str = "bob") -> dict[str, tuple[int, str]]:
    """Each role's (status, code) for ``src`` submitted by ``key``."""
    out = {}
    for role, body in _roles(api, src).items():
        r = api.client.post("/v1/jobs", json=body, headers=api.auth(key))
        out[role] = (r.status_code, r.json().get("code", ""))
    return out


def _run(api: Api, jid: str) -> dict[str, Any]:
    JobRunner(api.settings, api.worker_store(), LocalStorage(api.settings.storage_dir),
              worker="test").run(jid)
    return dict(api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json())


def _alice_job(api: Api) -> dict[str, Any]:
    job = _run(api, str(api.submit()["id"]))
    assert job["status"] == "succeeded", job["error"]
    return job


def test_s3_sources_on_local_storage_are_422_in_every_role(api: Api) -> None:
    got = _refusals(api, "s3://team-models/evals/set.jsonl", key="alice")
    assert got == {role: (422, "invalid_source") for role in got}, got
    assert api.r.llen(QUEUE) == 0 and not api.r.keys("maec:job:*")


def test_local_paths_into_the_service_storage_are_refused_in_every_role(
        api_factory: Any, tiny_models: TinyModels, tmp_path: Path) -> None:
    # An allowed root that holds the storage and work directories (a careless setup).
    api: Api = api_factory(local_roots=[tiny_models.root, tmp_path], **HIGH)
    alice = _alice_job(api)
    for case in hostile.service_dir_spellings(api.settings.storage_dir,
                                              api.settings.work_dir, tmp_path, alice["id"]):
        got = _refusals(api, case.source)
        assert got == {role: (422, case.code) for role in got}, (case.name, got)


def test_a_queued_record_naming_the_service_storage_fails_in_the_worker(
        api_factory: Any, tiny_models: TinyModels, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    api: Api = api_factory(local_roots=[tiny_models.root, tmp_path], **HIGH)
    alice = _alice_job(api)
    published = api.settings.storage_dir / "jobs" / alice["id"] / "a1"
    # A record written before the rule existed: submission let it through.
    with monkeypatch.context() as m:
        m.setattr("app.sources.check_not_service_storage", lambda source, _: source)
        job = api.submit(api.named(ability_donor=[str(published)]), key="bob")
    JobRunner(api.settings, api.worker_store(), LocalStorage(api.settings.storage_dir),
              worker="test").run(str(job["id"]))
    done = api.client.get(f"/v1/jobs/{job['id']}", headers=api.auth("bob")).json()
    assert done["status"] == "failed" and done["error"]["code"] == "source_forbidden", done
    assert done["result"] is None


def test_job_reference_reads_only_the_callers_own_succeeded_job(api: Api) -> None:
    alice = _alice_job(api)
    jid = alice["id"]
    ref = f"job:{jid}"
    body: dict[str, object] = {"recipe": {"merge_method": "linear", "models": [
        {"model": ref, "parameters": {"weight": 1.0}}]}}
    # Bob knows the id: the same answer as for an id that names no job.
    theirs = api.client.post("/v1/jobs", json=body, headers=api.auth("bob"))
    unknown_body = json.loads(json.dumps(body).replace(jid, UNKNOWN))
    unknown = api.client.post("/v1/jobs", json=unknown_body, headers=api.auth("bob"))
    for r in (theirs, unknown):
        assert (r.status_code, r.json()["code"]) == (422, "source_not_found"), r.text
    assert theirs.json()["message"].replace(jid, "ID") == \
        unknown.json()["message"].replace(UNKNOWN, "ID")
    assert theirs.json()["details"].keys() == unknown.json()["details"].keys()
    # In every role, and as a sub-path of the outputs.
    for src in (ref, f"job:{jid}/model.safetensors", f"job:{jid}/README.md"):
        got = _refusals(api, src)
        assert got == {role: (422, "source_not_found") for role in got}, (src, got)
    # Bob's own job that has not succeeded (queued here) is not a source either.
    queued = str(api.submit(key="bob")["id"])
    mine = api.client.post("/v1/jobs", json=json.loads(json.dumps(body).replace(jid, queued)),
                           headers=api.auth("bob"))
    assert (mine.status_code, mine.json()["code"]) == (422, "source_not_found")
    bad = api.client.post("/v1/jobs", json=json.loads(json.dumps(body).replace(
        ref, f"job:{jid}/../x")), headers=api.auth())
    assert (bad.status_code, bad.json()["code"]) == (422, "invalid_source")
    # Alice reuses her own output; the job reads exactly the files her job published.
    job: dict[str, Any] = api.submit(body)
    record = decode(api.r.hgetall(job_key(str(job["id"]))))
    assert record is not None and record.sources[ref]["kind"] == "job"
    done = _run(api, str(job["id"]))
    assert done["status"] == "succeeded", done["error"]
    published = {f["path"]: f["sha256"] for f in alice["result"]["files"]}
    read = done["result"]["manifest"]["inputs"][ref]["files"]
    assert read and all(published[name] == sha for name, sha in read.items()), read
    assert "model.safetensors" in read


def test_artifact_reuse_is_reported_only_within_one_key(api: Api) -> None:
    m = api.models
    body: dict[str, object] = {
        "method": "maec", "base": str(m.base), "ability_donor": [str(m.donor)],
        "language_base": str(m.lang), "parameters": {"key_ratio": 0.1}}
    runs = []
    for key in ("alice", "bob", "alice"):
        jid = str(api.submit(body, key=key)["id"])
        JobRunner(api.settings, api.worker_store(), LocalStorage(api.settings.storage_dir),
                  worker="test").run(jid)
        job = api.client.get(f"/v1/jobs/{jid}", headers=api.auth(key)).json()
        assert job["status"] == "succeeded", job["error"]
        runs.append(job["artifact_reused"])
    # Bob's extraction is his own, though alice's artifact holds the same numbers.
    assert runs == [False, False, True]
