from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from maec_client import (
    AuthError,
    Client,
    ClientConfig,
    Conflict,
    JobCancelled,
    JobFailed,
    NamedJob,
    NetworkError,
    NotFound,
    RateLimited,
    ServerError,
    ValidationFailed,
    WaitTimeout,
)
from maec_core.parsing import parse_recipe
from tests.client.conftest import BASE

MERGEKIT_YAML = """\
# a mergekit recipe, unchanged
merge_method: ties
base_model: s3://models/base
models:
  - model: s3://models/math
    parameters: {weight: 0.5, density: 0.4}
  - model: s3://models/code
    parameters: {weight: 0.5, density: 0.4}
parameters: {normalize: true}
dtype: bfloat16
"""


def posted(fake) -> list[dict]:
    return [json.loads(r.content) for r in fake.requests if r.method == "POST"
            and r.url.path == "/v1/jobs"]


def test_submit_mergekit_yaml_file_sends_recipe_form(client, fake, tmp_path):
    path = tmp_path / "ties.yaml"
    path.write_text(MERGEKIT_YAML)
    job = client.submit(path)
    assert job.id == "j_0001" and job.status == "queued" and job.method == "ties"
    (body,) = posted(fake)
    assert set(body) == {"recipe", "idempotency_key"}
    assert body["recipe"]["models"][1]["parameters"] == {"weight": 0.5, "density": 0.4}
    assert body["recipe"]["base_model"] == "s3://models/base"


def test_submit_a_mergekit_moe_config_sends_the_moe_form(client, fake, tmp_path):
    path = tmp_path / "moe.yaml"
    path.write_text("base_model: s3://models/base\ngate_mode: cheap_embed\nexperts:\n"
                    "  - source_model: s3://models/a\n    positive_prompts: [code]\n"
                    "  - source_model: s3://models/b\n    positive_prompts: [story]\n")
    client.submit(path)
    client.submit({"kind": "moe", "recipe": {"base_model": "s3://models/base",
                                             "experts": []}}, validate=True)
    first, second = posted(fake)
    assert set(first) == {"kind", "recipe", "idempotency_key"} and first["kind"] == "moe"
    assert first["recipe"]["experts"][1]["source_model"] == "s3://models/b"
    assert second["kind"] == "moe" and second["recipe"]["experts"] == []


def test_submit_str_path_yaml_text_dict_and_recipe_model_agree(client, fake, tmp_path):
    path = tmp_path / "r.yml"
    path.write_text(MERGEKIT_YAML)
    client.submit(str(path))
    client.submit(MERGEKIT_YAML)
    client.submit(parse_recipe(MERGEKIT_YAML))
    client.submit({"recipe": parse_recipe(MERGEKIT_YAML).model_dump(mode="json",
                                                                   exclude_none=True)})
    recipes = [b["recipe"] for b in posted(fake)]
    assert recipes[0] == recipes[1]
    # The Recipe model spells out defaults; the user's keys survive unchanged.
    for r in recipes[2:]:
        assert {k: r[k] for k in recipes[0]} == recipes[0]


def test_submit_named_form_from_kwargs_and_model(client, fake):
    client.submit_named("maec", base="s3://m/base", ability_donor=["s3://m/math"],
                        language_base="s3://m/sw", parameters={"key_ratio": 0.05},
                        name="sw-math")
    client.submit(NamedJob(method="maec", base="s3://m/base", ability_donor="s3://m/x",
                           language_base="s3://m/sw", shard_size=10**9))
    b1, b2 = posted(fake)
    assert "recipe" not in b1
    assert b1["method"] == "maec" and b1["ability_donor"] == ["s3://m/math"]
    assert b1["name"] == "sw-math" and b1["parameters"] == {"key_ratio": 0.05}
    assert "source_control" not in b1  # unset optionals left to the service's defaults
    assert b2["language_base"] == "s3://m/sw" and b2["ability_donor"] == ["s3://m/x"]
    assert b2["shard_size"] == 10**9
    with pytest.raises(ValidationFailed) as info:
        client.submit_named("maec", base="x", donors=["typo"])
    assert info.value.code == "invalid_request"


def test_invalid_recipe_fails_locally_with_the_service_code(client, fake):
    with pytest.raises(ValidationFailed) as info:
        client.submit({"merge_method": "ties", "models": [{"model": "s3://a"}]})
    assert info.value.code == "invalid_recipe" and "needs base_model" in info.value.message
    with pytest.raises(ValidationFailed, match=r"unknown key 'models\.0\.modle'"):
        client.submit({"merge_method": "linear", "models": [{"modle": "s3://a"}]})
    with pytest.raises(ValidationFailed, match="slices"):
        client.submit("slices: []\nmerge_method: passthrough\n")
    with pytest.raises(ValidationFailed, match="not a job"):
        client.submit({"base": "x"})
    assert fake.requests == []  # nothing reached the service


def test_service_validation_error_surfaces_typed(client, fake):
    with pytest.raises(ValidationFailed) as info:
        client.submit({"merge_method": "nope"}, validate=False)
    exc = info.value
    assert (exc.code, exc.status, exc.details) == ("invalid_recipe", 422,
                                                   {"key": "merge_method"})


def test_submit_retry_after_503_reuses_idempotency_key(client, fake, clock):
    fake.fail_next = [503, 0]  # an error answer, then a connection failure
    job = client.submit(MERGEKIT_YAML, idempotency_key="once")
    again = client.submit(MERGEKIT_YAML, idempotency_key="once")
    assert job.id == again.id and len(fake.jobs) == 1
    keys = {b["idempotency_key"] for b in posted(fake)}
    assert keys == {"once"}
    assert clock.sleeps == [0.5, 1.0]  # exponential backoff between the three attempts


def test_generated_idempotency_keys_differ_per_call(client, fake):
    client.submit(MERGEKIT_YAML)
    client.submit(MERGEKIT_YAML)
    k1, k2 = (b["idempotency_key"] for b in posted(fake))
    assert k1 != k2 and len(fake.jobs) == 2


def test_rate_limit_honours_retry_after_then_gives_up(client, fake, clock):
    fake.fail_next = [429, 429, 429, 429]
    with pytest.raises(RateLimited) as info:
        client.get("j_0001")
    assert info.value.retry_after == 0.0 and len(fake.requests) == 4
    assert clock.sleeps == [0.0, 0.0, 0.0]


def test_network_failure_becomes_network_error(client, fake):
    fake.fail_next = [0, 0, 0, 0]
    with pytest.raises(NetworkError, match="ConnectError"):
        client.get("j_0001")


def test_auth_and_not_found(fake, client):
    bad = Client(config=ClientConfig(url=BASE, api_key="wrong"), transport=fake.transport())
    with pytest.raises(AuthError) as info:
        bad.get("j_0001")
    assert info.value.code == "unauthorized" and info.value.status == 401
    with pytest.raises(NotFound) as nf:
        client.get("j_9999")
    assert nf.value.code == "job_not_found"
    assert bad.health() == {"status": "ok"}  # /healthz needs no key


def test_api_key_not_sent_to_other_origins(client, fake):
    client.http.get("http://storage.example:9000/bucket/obj")
    client.http.get("/healthz")
    foreign, own = fake.requests
    assert "authorization" not in foreign.headers
    assert own.headers["authorization"] == "Bearer k1"


def test_list_follows_cursors_across_pages(client, fake):
    for _ in range(7):
        fake.add_job()
    fake.jobs["j_0003"]["status"] = "failed"
    ids = [j.id for j in client.iter_jobs(page_size=3)]
    assert ids == [f"j_{i:04d}" for i in range(7, 0, -1)]
    pages = [r for r in fake.requests if r.url.path == "/v1/jobs"]
    assert len(pages) == 3
    assert [j.id for j in client.list_jobs(limit=4)] == ["j_0007", "j_0006", "j_0005",
                                                         "j_0004"]
    assert [j.id for j in client.list_jobs(status="failed")] == ["j_0003"]
    page = client.list_page(limit=2)
    assert len(page.jobs) == 2 and page.next_cursor == "j_0006"


def test_cancel_queued_and_conflict_when_finished(client, fake):
    job = fake.add_job()
    got = client.cancel(job["id"])
    assert got.status == "cancelled" and got.cancel_requested
    assert client.cancel(got).status == "cancelled", "a retried cancel is answered again"
    done = fake.add_job(status="succeeded")
    with pytest.raises(Conflict) as info:
        client.cancel(done["id"])
    assert info.value.code == "job_finished" and info.value.status == 409


def test_wait_polls_with_backoff_reports_progress_and_returns(client, fake, clock):
    job = fake.add_job()
    run = {"status": "running", "stage": "combine"}
    fake.script[job["id"]] = [
        {**run, "progress": {"fraction": 0.1, "done": 1, "total": 10}},
        {**run, "progress": {"fraction": 0.1, "done": 1, "total": 10}},
        {**run, "progress": {"fraction": 0.1, "done": 1, "total": 10}},
        {**run, "progress": {"fraction": 0.5, "done": 5, "total": 10}},
        {"status": "succeeded", "stage": None,
         "progress": {"fraction": 1.0, "done": 10, "total": 10}},
    ]
    seen = []
    done = client.wait(job["id"], on_progress=lambda j: seen.append((j.status,
                                                                     j.progress.done)))
    assert done.status == "succeeded"
    assert seen == [("running", 1), ("running", 5), ("succeeded", 10)]
    # 0.5 grows 1.5x while nothing changes, and resets once the job moves.
    assert clock.sleeps == [0.5, 0.75, 1.125, 0.5]


def test_wait_raises_typed_on_failure_cancel_and_timeout(client, fake, clock):
    failed = fake.add_job(status="failed", error={"code": "non_finite_output",
                                                  "message": "NaN in layer 3",
                                                  "details": {"tensor": "w"}})
    with pytest.raises(JobFailed) as info:
        client.wait(failed["id"])
    assert info.value.code == "non_finite_output" and info.value.details == {"tensor": "w"}
    assert info.value.job.id == failed["id"]
    assert client.wait(failed["id"], raise_on_failure=False).status == "failed"

    cancelled = fake.add_job(status="cancelled")
    with pytest.raises(JobCancelled):
        client.wait(cancelled["id"])

    stuck = fake.add_job(status="running")
    with pytest.raises(WaitTimeout) as to:
        client.wait(stuck["id"], timeout=10, max_interval=2)
    assert to.value.job.status == "running"
    assert 10 <= clock.now < 10.01


def test_non_json_and_off_contract_answers_are_server_errors(fake):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/jobs/a":
            return httpx.Response(200, text="<html>")
        return httpx.Response(200, json={"unexpected": True})

    c = Client(config=ClientConfig(url=BASE, api_key="k"),
               transport=httpx.MockTransport(handler))
    with pytest.raises(ServerError, match="non-JSON"):
        c.get("a")
    with pytest.raises(ServerError, match="not a Job"):
        c.get("b")


def test_unknown_job_fields_and_statuses_are_tolerated(client, fake):
    job = fake.add_job(status="paused", new_field={"x": 1})
    got = client.get(job["id"])
    assert got.status == "paused" and not got.done
    assert got.model_extra == {"new_field": {"x": 1}}


def test_client_package_does_not_import_torch():
    code = ("import sys, maec_client, maec_client.download;"
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_delete_pin_unpin_and_submit_pinned(client, fake, clock):
    c = client
    job = c.submit(MERGEKIT_YAML, pinned=True)
    assert json.loads(fake.requests[-1].content)["pinned"] is True
    with pytest.raises(Conflict) as active:
        c.delete(job)
    assert active.value.code == "job_active"
    fake.finish(job.id, {"a.bin": b"x"})
    assert c.pin(job).pinned is True and c.unpin(job.id).pinned is False
    fake.fail_next = [503]  # a delete is retried like any other call
    c.delete(job)
    assert job.id not in fake.jobs and clock.sleeps
    with pytest.raises(NotFound):
        c.delete(job.id)
    c.delete(job.id, missing_ok=True)
    assert fake.requests[-1].method == "DELETE"
    assert fake.requests[-1].url.path == f"/v1/jobs/{job.id}"


def test_submit_gguf_asks_for_a_gguf_output_in_either_form(client, fake):
    client.submit_named("task_arithmetic", ability_donor="s3://m/d", language_base="s3://m/l",
                        output={"gguf": "q8_0"})
    client.submit({"method": "task_arithmetic", "ability_donor": ["s3://m/d"],
                   "language_base": "s3://m/l"}, gguf="bf16")
    first, second = posted(fake)
    assert first["output"] == {"gguf": "q8_0"} and second["output"] == {"gguf": "bf16"}
