"""The job as the service stores and serves it is the contract's Job, field for field."""

from __future__ import annotations

import json

import app.submission
from app.api.schemas import JobList, JobOut, Problem
from app.jobs.api_store import PUBLIC_FIELDS
from app.jobs.record import INTERNAL_FIELDS, JobRecord
from maec_client import Job as ClientJob
from maec_client import NamedJob as ClientNamedJob
from maec_contract import ErrorBody, Job, JobPage, JobRequest, NamedJob

FILE = {"path": "model.safetensors", "size": 10, "sha256": "a" * 64,
        "url": "/v1/jobs/j_1/files/model.safetensors"}


def record(**fields) -> JobRecord:
    base = {"id": "j_1", "owner": "alice", "method": "linear", "recipe": {"merge_method":
            "linear", "models": [{"model": "s3://m/a"}]}, "created_at": "2026-01-01T00:00Z",
            "sources": {"s3://m/a": {"kind": "s3"}}, "idempotency_key": "k",
            "worker": "w1", "lease_until": 5.0, "result_prefix": "jobs/j_1/1"}
    return JobRecord.model_validate(base | fields)


def test_the_client_the_api_and_the_store_share_one_declaration():
    assert ClientJob is Job and JobOut is Job and JobList is JobPage and Problem is ErrorBody
    assert app.submission.JobRequest is JobRequest and ClientNamedJob is NamedJob
    # The store assembles a job's body from its hash in this order, without the model.
    assert [f.decode() for f in PUBLIC_FIELDS] == list(Job.model_fields)
    # The record is the contract's Job plus bookkeeping, not a second list of its fields.
    assert issubclass(JobRecord, Job)
    assert set(INTERNAL_FIELDS) == {"owner", "sources", "idempotency_key", "lease_until",
                                    "worker", "result_prefix", "attempt_started",
                                    "published_bytes", "artifact_keys", "cost", "seq",
                                    "shards"}


def test_served_job_json_round_trips_byte_for_byte_through_the_contract():
    recs = [
        record(),
        record(status="running", stage="combine", attempts=1, started_at="t1",
               progress={"fraction": 0.5, "done": 1, "total": 2}),
        record(status="failed", finished_at="t2", error={"code": "worker_lost",
               "message": "gone", "details": {"attempts": 3}}),
        record(status="succeeded", artifact_reused=True, result={
            "manifest": {"format_version": 1, "files": [FILE]}, "report": {"s": 1.5},
            "files": [FILE], "core_seconds": 0.25}),
    ]
    for rec in recs:
        served = json.dumps(rec.public(), separators=(",", ":"))
        parsed = Job.model_validate_json(served)
        assert json.dumps(parsed.model_dump(mode="json"), separators=(",", ":")) == served
        assert not set(rec.public()) & set(INTERNAL_FIELDS)


def test_published_schema_requires_every_field_and_names_the_statuses():
    schema = Job.model_json_schema(mode="serialization")
    assert schema["required"] == list(Job.model_fields)
    assert schema["properties"]["status"]["enum"] == [
        "queued", "running", "publishing", "succeeded", "failed", "cancelled"]
    files = schema["$defs"]["FileInfo"]
    assert files["required"] == ["path", "size", "sha256", "url"]
    assert files["properties"]["url"]["type"] == "string"


def test_client_parsing_tolerates_newer_and_sparser_answers():
    job = Job.model_validate({"id": "j_1", "status": "paused", "extra": 1})
    assert job.status == "paused" and job.method == "" and job.model_extra == {"extra": 1}
    assert not job.done


def test_request_forms_narrow_the_one_request_model():
    body = NamedJob.model_validate({"method": "maec", "ability_donor": "s3://m/x",
                                    "language_base": "s3://m/sw"}).body()
    assert body == {"method": "maec", "ability_donor": ["s3://m/x"],
                    "language_base": "s3://m/sw"}
    assert JobRequest.model_validate(body).body() == body
    for bad in ({"method": "maec"}, {"method": "maec", "ability_donor": ["a"],
                                     "language_base": "b", "recipe": {}},
                {"method": "maec", "ability_donor": ["a"], "language_base": "b",
                 "dtype": "float64"}):
        for model in (JobRequest, NamedJob):
            try:
                model.model_validate(bad)
            except ValueError:
                continue
            raise AssertionError(f"{model.__name__} accepted {bad}")


def test_every_name_the_package_lists_is_its_submodule_s_own_and_responses_load_late():
    """The package answers for its modules' names (the response models imported on first
    use): each listed name is the object its module declares."""
    import subprocess
    import sys

    import maec_contract
    from maec_contract import jobs, requests

    for name in maec_contract.__all__:
        owner = jobs if hasattr(jobs, name) else requests
        assert getattr(maec_contract, name) is getattr(owner, name), name
    assert set(maec_contract.__all__) <= set(dir(maec_contract))
    code = ("import sys, maec_contract; assert 'maec_contract.jobs' not in sys.modules;"
            "from maec_contract import Job; assert Job.__module__ == 'maec_contract.jobs'")
    subprocess.run([sys.executable, "-c", code], check=True)
