"""The worker's job pipeline run in-process, and the files route over its results."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from app.jobs.worker_store import WorkerJobStore
from app.storage.local import LocalStorage
from tests import hostile
from tests.api.conftest import Api
from worker.runner import JobRunner


def _runner(api: Api, store: WorkerJobStore | None = None) -> JobRunner:
    return JobRunner(api.settings, store or api.worker_store(),
                     LocalStorage(api.settings.storage_dir), worker="test")


def _job(api: Api, jid: str) -> dict[str, Any]:
    return dict(api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json())


def test_job_runs_publishes_and_serves_ranges(api: Api) -> None:
    jid = str(api.submit()["id"])
    path = "model.safetensors"
    early = api.client.get(f"/v1/jobs/{jid}/files/{path}", headers=api.auth())
    assert early.status_code == 404 and early.json()["code"] == "file_not_found"
    assert _runner(api).run(jid) == "succeeded"
    job = _job(api, jid)
    assert job["status"] == "succeeded" and job["attempts"] == 1
    assert job["progress"]["fraction"] == 1.0 and job["stage"] is None
    assert job["finished_at"] and job["error"] is None
    result = job["result"]
    assert result["core_seconds"] > 0
    listed = {f["path"]: f for f in result["files"]}
    assert set(listed) == {f["path"] for f in result["manifest"]["files"]} | {"manifest.json"}
    for name, f in listed.items():
        r = api.client.get(f["url"], headers=api.auth())
        assert r.status_code == 200, name
        assert hashlib.sha256(r.content).hexdigest() == f["sha256"]
        assert r.headers["etag"] == f'"{f["sha256"]}"'
        assert r.headers["accept-ranges"] == "bytes"
    whole = api.client.get(f"/v1/jobs/{jid}/files/{path}", headers=api.auth()).content
    size = len(whole)
    for rng, want, content_range in (
        ("bytes=0-7", whole[:8], f"bytes 0-7/{size}"),
        ("bytes=100-", whole[100:], f"bytes 100-{size - 1}/{size}"),
        ("bytes=-16", whole[-16:], f"bytes {size - 16}-{size - 1}/{size}"),
        (f"bytes=10-{size + 50}", whole[10:], f"bytes 10-{size - 1}/{size}"),
    ):
        r = api.client.get(f"/v1/jobs/{jid}/files/{path}",
                           headers={**api.auth(), "Range": rng})
        assert r.status_code == 206, rng
        assert r.content == want and r.headers["content-range"] == content_range
    for rng in (f"bytes={size}-", "bytes=-0", "bytes=9-3"):
        r = api.client.get(f"/v1/jobs/{jid}/files/{path}",
                           headers={**api.auth(), "Range": rng})
        assert r.status_code == 416 and r.json()["code"] == "range_not_satisfiable", rng
        assert r.headers["content-range"] == f"bytes */{size}"
    multi = api.client.get(f"/v1/jobs/{jid}/files/{path}",
                           headers={**api.auth(), "Range": "bytes=0-1,4-5"})
    assert multi.status_code == 200 and multi.content == whole
    # Local storage cannot presign: redirect=true falls back to streaming.
    assert api.client.get(f"/v1/jobs/{jid}/files/{path}", params={"redirect": "true"},
                          headers=api.auth()).content == whole
    # Only listed files are served (httpx would normalise a literal "..", so encode it).
    for bad in ("nope.bin", "%2e%2e/%2e%2e/etc/passwd", "sub/%2e%2e/model.safetensors"):
        r = api.client.get(f"/v1/jobs/{jid}/files/{bad}", headers=api.auth())
        assert r.status_code == 404 and r.json()["code"] in ("file_not_found", "not_found")
    metrics = api.client.get("/metrics", headers=api.operator()).text
    assert 'maec_jobs_finished_total{status="succeeded"} 1.0' in metrics
    assert "maec_job_duration_seconds_count 1.0" in metrics
    total = sum(f["size"] for f in result["files"])
    assert f"maec_published_bytes_total {float(total)}" in metrics
    # A redelivered message for a finished job is a no-op.
    assert _runner(api).run(jid) == "done"


def test_files_lists_what_the_job_published_to_its_owner_only(api: Api) -> None:
    jid = str(api.submit()["id"])
    for url in (f"/v1/jobs/{jid}/files", f"/v1/jobs/{jid}/files/"):
        early = api.client.get(url, headers=api.auth())
        assert early.status_code == 200, url
        assert early.json() == {"job_id": jid, "status": "queued", "files": []}
    assert _runner(api).run(jid) == "succeeded"
    manifest = _job(api, jid)["result"]["manifest"]
    for url in (f"/v1/jobs/{jid}/files", f"/v1/jobs/{jid}/files/"):
        r = api.client.get(url, headers=api.auth())
        assert r.status_code == 200, url
        body = r.json()
        assert (body["job_id"], body["status"]) == (jid, "succeeded")
        listed = {f["path"]: f for f in body["files"]}
        assert set(listed) == {f["path"] for f in manifest["files"]} | {"manifest.json"}
        for entry in manifest["files"]:
            got = listed[entry["path"]]
            assert (got["size"], got["sha256"]) == (entry["size"], entry["sha256"])
        for name, f in listed.items():
            content = api.client.get(f["url"], headers=api.auth()).content
            assert len(content) == f["size"] and \
                hashlib.sha256(content).hexdigest() == f["sha256"], name
        other = api.client.get(url, headers=api.auth("bob"))
        assert other.status_code == 404 and other.json()["code"] == "job_not_found"
    assert api.client.get(f"/v1/jobs/{jid}/files").status_code == 401
    missing = api.client.get("/v1/jobs/j_0123/files", headers=api.auth())
    assert missing.status_code == 404 and missing.json()["code"] == "job_not_found"
    spec = api.client.get("/openapi.json", headers=api.auth()).json()
    listing = spec["paths"]["/v1/jobs/{job_id}/files"]["get"]
    assert listing["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/FileList"}


def test_published_manifest_names_inputs_by_reference(api: Api) -> None:
    m = api.models
    (api.root / "extra" / "wiki.txt").write_text("w1 w7 w3 w9 w4 w12\n\nw20 w3 w17 w25\n")
    sets = [{"name": "wiki", "language": "sw", "kind": "perplexity",
             "path": str(api.root / "extra" / "wiki.txt")}]
    jid = str(api.submit(api.named("maec", evaluate=sets))["id"])
    assert _runner(api).run(jid) == "succeeded"
    result = _job(api, jid)["result"]
    served = api.client.get(f"/v1/jobs/{jid}/files/manifest.json", headers=api.auth())
    manifest = served.json()
    assert manifest == result["manifest"]
    refs = {str(m.base), str(m.donor), str(m.lang), sets[0]["path"]}
    api.assert_named_by_reference(manifest, refs)
    recipe = manifest["recipe"]
    assert (recipe["base_model"], recipe["language_base"]) == (str(m.base), str(m.lang))
    assert [a["model"] for a in recipe["abilities"]] == [str(m.donor)]
    # The job's report names the donor as the recipe does, too.
    assert [a["model"] for a in result["report"]["abilities"]] == [str(m.donor)]
    # The manifest's own entry is the file as published.
    [entry] = [f for f in result["files"] if f["path"] == "manifest.json"]
    assert entry["size"] == len(served.content)
    assert entry["sha256"] == hashlib.sha256(served.content).hexdigest()


class CancelAt(WorkerJobStore):
    """The real store, plus a user pressing cancel when the job reaches ``stage``."""

    def __init__(self, api: Api, jid: str, stage: str, done: int = 0) -> None:
        super().__init__(api.r)
        self.api, self.jid, self.stage, self.done, self.fired = api, jid, stage, done, False

    def update(self, job_id: str, attempt: int, fields: dict[str, Any]) -> int:
        if (not self.fired and fields.get("stage") == self.stage
                and fields["progress"]["done"] >= self.done):
            self.fired = True
            r = self.api.client.post(f"/v1/jobs/{self.jid}/cancel", headers=self.api.auth())
            assert r.status_code == 202
        return super().update(job_id, attempt, fields)


@pytest.mark.parametrize(("method", "stage", "done"), [
    ("task_arithmetic", "combine", 1), ("maec", "extract", 1), ("task_arithmetic",
                                                                "publish", 2),
])
def test_cancel_stops_a_running_job_and_cleans_staging(api: Api, method: str, stage: str,
                                                       done: int) -> None:
    jid = str(api.submit(api.named(method))["id"])
    store = CancelAt(api, jid, stage, done)
    assert _runner(api, store).run(jid) == "cancelled"
    assert store.fired
    job = _job(api, jid)
    assert job["status"] == "cancelled" and job["cancel_requested"] and job["result"] is None
    assert LocalStorage(api.settings.storage_dir).list(f"jobs/{jid}/") == []
    assert not (api.settings.work_dir / "jobs" / jid / "a1").exists()


def test_maec_artifact_is_stored_and_reused(api: Api) -> None:
    m = api.models
    first = str(api.submit(api.named("maec"))["id"])
    assert _runner(api).run(first) == "succeeded"
    assert _job(api, first)["artifact_reused"] is False
    stored = LocalStorage(api.settings.storage_dir).list("artifacts/")
    assert any(o.key.endswith("/ability.json") for o in stored)
    # Another language base, same donor: the ability vector is not extracted again,
    # even by a worker with an empty local artifact cache.
    second = str(api.submit(api.named("maec", language_base=str(m.lang2)))["id"])
    fresh = api.settings.model_copy(update={"work_dir": api.root / "work2"})
    runner = JobRunner(fresh, api.worker_store(), LocalStorage(fresh.storage_dir))
    assert runner.run(second) == "succeeded"
    job = _job(api, second)
    assert job["artifact_reused"] is True
    assert job["result"]["report"]["abilities"][0]["artifact_reused"] is True
    assert job["result"]["report"]["artifact_keys"] == \
        _job(api, first)["result"]["report"]["artifact_keys"]


def test_a_local_artifact_copy_is_used_only_while_storage_holds_the_artifact(api: Api
                                                                             ) -> None:
    storage = LocalStorage(api.settings.storage_dir)
    first = str(api.submit(api.named("maec"))["id"])
    assert _runner(api).run(first) == "succeeded"
    [key] = _job(api, first)["result"]["report"]["artifact_keys"]
    second = str(api.submit(api.named("maec", language_base=str(api.models.lang2)))["id"])
    assert _runner(api).run(second) == "succeeded"
    assert _job(api, second)["artifact_reused"] is True
    copy = api.settings.work_dir / "artifacts" / "objects" / key
    assert (copy / "ability.json").is_file()  # fetched for the second job, kept
    # Collected by retention: the worker's copy is not reused, but dropped.
    storage.delete_prefix(f"artifacts/{key}/")
    third = str(api.submit(api.named("maec"))["id"])
    assert _runner(api).run(third) == "succeeded"
    assert _job(api, third)["artifact_reused"] is False and not copy.exists()
    assert storage.head(f"artifacts/{key}/ability.json") is not None  # stored again


def test_merge_failure_is_recorded_with_its_code(api: Api) -> None:
    bad = hostile.nan_weights(api.models.donor, api.root / "extra" / "nan")
    jid = str(api.submit(api.named(ability_donor=[str(bad)]))["id"])
    assert _runner(api).run(jid) == "failed"
    job = _job(api, jid)
    assert job["error"]["code"] == "non_finite_output"
    assert job["result"] is None
    assert LocalStorage(api.settings.storage_dir).list(f"jobs/{jid}/") == []
