"""Routes: auth, submit/read/list/cancel, idempotency, metrics, readiness."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from app.queue import QUEUE, TAKE_TASK_NAME
from tests.api.conftest import Api
from tests.stack import ROOT


def test_api_module_does_not_import_torch() -> None:
    code = ("import sys, app.api.main, app.submission, app.sources; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'worker', 'transformers'))))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_healthz_needs_no_key(api: Api) -> None:
    r = api.client.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", "/v1/jobs/j_0"),
    ("POST", "/v1/jobs/j_0/cancel"), ("GET", "/v1/jobs/j_0/files/x"),
    ("GET", "/readyz"), ("GET", "/metrics"),
])
@pytest.mark.parametrize("header", [None, "Bearer wrong-key", "Basic abc", "Bearer "])
def test_every_other_endpoint_needs_a_valid_key(api: Api, method: str, path: str,
                                                header: str | None) -> None:
    headers = {"Authorization": header} if header else {}
    r = api.client.request(method, path, headers=headers, json={})
    assert r.status_code == 401
    assert r.json()["code"] == "unauthorized"
    assert r.headers["www-authenticate"] == "Bearer"


def test_dev_mode_acts_as_dev_key(api_factory: object) -> None:
    api: Api = api_factory(dev_mode=True, api_keys={})  # type: ignore[operator]
    job = api.client.post("/v1/jobs", json=api.named()).json()
    assert api.client.get(f"/v1/jobs/{job['id']}").status_code == 200
    assert api.r.hget(f"maec:job:{job['id']}", "owner") == b'"dev"'


def test_no_key_can_reach_dev_modes_jobs(api_factory: object,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs made in dev mode stay dev mode's: the service, restarted with keys over the
    same Redis, refuses to start with a key named after dev mode's owner."""
    from app.settings import SettingsInvalid, get_settings

    dev: Api = api_factory(dev_mode=True, api_keys={})  # type: ignore[operator]
    job = dev.client.post("/v1/jobs", json=dev.named()).json()
    assert dev.r.hget(f"maec:job:{job['id']}", "owner") == b'"dev"'
    monkeypatch.setenv("MAEC_DEV_MODE", "false")
    monkeypatch.setenv("MAEC_API_KEYS", json.dumps({"dev": "0" * 64, "alice": "1" * 64}))
    get_settings.cache_clear()
    try:
        with pytest.raises(SettingsInvalid, match="reserved for dev mode") as err:
            get_settings()
        assert "0" * 64 not in str(err.value)
    finally:
        get_settings.cache_clear()


def test_submit_queues_a_job_and_a_message(api: Api) -> None:
    r = api.client.post("/v1/jobs", json=api.named(name="first"), headers=api.auth())
    assert r.status_code == 202
    job = r.json()
    assert r.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["status"] == "queued" and job["attempts"] == 0 and job["name"] == "first"
    assert job["recipe"]["merge_method"] == "task_arithmetic"
    assert [m["model"] for m in job["recipe"]["models"]] == [
        str(api.models.donor), str(api.models.lang)]
    assert set(job) == {"id", "status", "stage", "progress", "method", "name", "recipe",
                        "warnings",
                        "created_at", "started_at", "finished_at", "attempts",
                        "cancel_requested", "artifact_reused", "error", "result",
                        "callback_url", "webhook",
                        "pinned", "priority", "pool", "ran_pool", "estimate", "measured",
                        "queue"}
    assert job["pool"] == QUEUE and job["priority"] == "normal"
    assert job["estimate"]["host_memory_bytes"] > 0 and job["estimate"]["cost"] == 1
    # The Celery message wakes a worker of the job's pool; the job is the scheduler's.
    messages = [json.loads(m) for m in api.r.lrange(QUEUE, 0, -1)]
    assert [(m["headers"]["task"], json.loads(
        __import__("base64").b64decode(m["body"]))[0]) for m in messages] == [
        (TAKE_TASK_NAME, [QUEUE])]
    read = api.client.get(f"/v1/jobs/{job['id']}", headers=api.auth()).json()
    # Read while queued, the job also shows its place (first; no worker live yet).
    assert read.pop("queue") == {"position": 0, "eta_s": None, "pool": QUEUE}
    assert job.pop("queue") is None
    assert read == job


def test_named_form_per_model_parameters(api: Api) -> None:
    job = api.submit(api.named("ties", parameters={"density": [0.5, 0.7], "weight": 1.0}))
    models = job["recipe"]["models"]  # type: ignore[index]
    assert [m["parameters"] for m in models] == [
        {"density": 0.5, "weight": 1.0}, {"density": 0.7, "weight": 1.0}]
    swap = api.submit(api.named("layer_swap", base=None))
    assert [m["parameters"]["role"] for m in swap["recipe"]["models"]] == [  # type: ignore[index]
        "ability", "language"]
    maec = api.submit(api.named("maec", parameters={"key_ratio": 0.1, "mu": [0.5]}))
    recipe = maec["recipe"]
    assert recipe["abilities"][0]["mu"] == 0.5  # type: ignore[index]
    assert recipe["parameters"] == {"key_ratio": 0.1}  # type: ignore[index]


def test_recipe_form(api: Api) -> None:
    m = api.models
    job = api.submit({"recipe": {"merge_method": "ties", "base_model": str(m.base),
                                 "models": [{"model": str(m.donor),
                                             "parameters": {"density": 0.5}}],
                                 "parameters": {"lambda": 0.8}}})
    assert job["method"] == "ties"


def test_other_keys_jobs_are_invisible(api: Api) -> None:
    job = api.submit()
    jid = job["id"]
    for method, path in (("GET", f"/v1/jobs/{jid}"), ("POST", f"/v1/jobs/{jid}/cancel"),
                         ("GET", f"/v1/jobs/{jid}/files/config.json")):
        r = api.client.request(method, path, headers=api.auth("bob"))
        assert r.status_code == 404 and r.json()["code"] == "job_not_found", path
    assert api.client.get("/v1/jobs", headers=api.auth("bob")).json() == {
        "jobs": [], "next_cursor": None}
    assert api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).status_code == 200


def test_idempotency_key_returns_the_existing_job(api: Api) -> None:
    first = api.client.post("/v1/jobs", json=api.named(idempotency_key="k1"),
                            headers=api.auth())
    again = api.client.post("/v1/jobs", json=api.named(idempotency_key="k1"),
                            headers=api.auth())
    assert first.status_code == 202 and again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["location"] == first.headers["location"]
    other = api.client.post("/v1/jobs", json=api.named(idempotency_key="k1"),
                            headers=api.auth("bob"))
    assert other.status_code == 202 and other.json()["id"] != first.json()["id"]
    fresh = api.client.post("/v1/jobs", json=api.named(idempotency_key="k2"),
                            headers=api.auth())
    assert fresh.status_code == 202 and fresh.json()["id"] != first.json()["id"]
    assert api.r.llen(QUEUE) == 3


def test_list_is_newest_first_with_cursor_and_status_filter(api: Api) -> None:
    ids = []
    for _ in range(5):
        ids.append(api.submit()["id"])
        time.sleep(0.002)
    api.client.post(f"/v1/jobs/{ids[1]}/cancel", headers=api.auth())
    seen, cursor = [], None
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = api.client.get("/v1/jobs", params=params, headers=api.auth()).json()
        assert len(page["jobs"]) <= 2
        seen += [j["id"] for j in page["jobs"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == ids[::-1]
    queued = api.client.get("/v1/jobs", params={"status": "queued"}, headers=api.auth()).json()
    assert [j["id"] for j in queued["jobs"]] == [ids[4], ids[3], ids[2], ids[0]]
    cancelled = api.client.get("/v1/jobs", params={"status": "cancelled", "limit": 1},
                               headers=api.auth()).json()
    assert [j["id"] for j in cancelled["jobs"]] == [ids[1]]
    # A filtered page may hand out a cursor whose next page is empty (we cannot know
    # without scanning); following it must end the listing.
    if cancelled["next_cursor"]:
        rest = api.client.get("/v1/jobs", params={"status": "cancelled",
                                                   "cursor": cancelled["next_cursor"]},
                              headers=api.auth()).json()
        assert rest == {"jobs": [], "next_cursor": None}
    for bad in ({"status": "nope"}, {"limit": 0}, {"limit": 101}, {"cursor": "x y"}):
        r = api.client.get("/v1/jobs", params=bad, headers=api.auth())
        assert r.status_code == 422 and r.json()["code"] == "invalid_request", bad


def test_cancel_queued_job_is_idempotent_and_a_finished_job_is_409(api: Api) -> None:
    jid = api.submit()["id"]
    r = api.client.post(f"/v1/jobs/{jid}/cancel", headers=api.auth())
    assert r.status_code == 202
    assert r.json()["status"] == "cancelled" and r.json()["cancel_requested"] is True
    assert r.json()["finished_at"]
    again = api.client.post(f"/v1/jobs/{jid}/cancel", headers=api.auth())
    assert again.status_code == 202 and again.json() == r.json(), "a retried cancel"
    done = api.submit()["id"]
    api.worker_store().claim(done, worker="w", lease_s=30, max_attempts=3)
    api.worker_store().transition(done, allowed=("running",), to="succeeded", attempt=1)
    finished = api.client.post(f"/v1/jobs/{done}/cancel", headers=api.auth())
    assert finished.status_code == 409 and finished.json()["code"] == "job_finished"
    assert finished.json()["details"]["status"] == "succeeded"
    missing = api.client.post("/v1/jobs/j_0123/cancel", headers=api.auth())
    assert missing.status_code == 404 and missing.json()["code"] == "job_not_found"


def test_too_many_active_jobs(api_factory: object) -> None:
    api: Api = api_factory(max_active_jobs_per_key=2)  # type: ignore[operator]
    a, _b = api.submit(), api.submit()
    r = api.client.post("/v1/jobs", json=api.named(), headers=api.auth())
    assert r.status_code == 429 and r.json()["code"] == "too_many_jobs"
    assert "retry-after" in r.headers
    assert api.client.post("/v1/jobs", json=api.named(), headers=api.auth("bob")
                           ).status_code == 202
    api.client.post(f"/v1/jobs/{a['id']}/cancel", headers=api.auth())
    assert api.client.post("/v1/jobs", json=api.named(), headers=api.auth()
                           ).status_code == 202


def test_request_too_large(api: Api) -> None:
    body = api.named(name="x" * 100) | {"parameters": {"pad": "y" * (2 * 1024 * 1024)}}
    r = api.client.post("/v1/jobs", json=body, headers=api.auth())
    assert r.status_code == 413 and r.json()["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit holds for streamed bodies too
        for _ in range(40):
            yield b"x" * 65536

    r = api.client.post("/v1/jobs", content=chunks(),
                        headers={**api.auth(), "content-type": "application/json"})
    assert r.status_code == 413


def test_readyz_counts_heartbeating_workers(api: Api) -> None:
    r = api.client.get("/readyz", headers=api.auth())
    assert r.status_code == 503
    assert r.json() == {"redis": True, "storage": True, "workers": 0}
    api.worker_store().heartbeat("w1")
    r = api.client.get("/readyz", headers=api.auth())
    assert r.status_code == 200 and r.json()["workers"] == 1
    api.r.zadd("maec:workers", {"w1": time.time() - 3600})
    assert api.client.get("/readyz", headers=api.auth()).status_code == 503


def test_metrics_report_jobs_by_status(api: Api) -> None:
    api.submit()
    jid = api.submit()["id"]
    api.client.post(f"/v1/jobs/{jid}/cancel", headers=api.auth())
    text = api.client.get("/metrics", headers=api.operator()).text
    assert 'maec_jobs{status="queued"} 1.0' in text
    assert 'maec_jobs{status="cancelled"} 1.0' in text
    assert "maec_job_duration_seconds_bucket" in text
    assert "maec_published_bytes_total" in text


def test_openapi_lists_the_v1_routes(api: Api) -> None:
    spec = api.client.get("/openapi.json", headers=api.auth()).json()
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/cancel",
            "/v1/jobs/{job_id}/files/{path}", "/healthz", "/readyz", "/metrics"} <= set(
        spec["paths"])
    assert api.client.get("/docs", headers=api.auth()).status_code == 200
    assert spec["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    assert spec["paths"]["/healthz"]["get"]["security"] == []
    assert spec["paths"]["/v1/jobs/{job_id}"]["get"]["security"] == [{"apiKey": []}]
