"""Job kinds resolve through their registries, never by a name tested elsewhere: the
contract's request union picks the body model by ``kind`` (a body without one is a
merge), the API's registry the submission, the worker's the plan."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.jobs.record import JobRecord
from app.kinds import record_kind, submission_of
from maec_contract import JobRequest, MoeJobRequest, parse_job_request
from worker.kinds import kind_of
from worker.moe import MOE, MoeJob
from worker.stages import MERGE, MergeJob

MOE_CONFIG = {"base_model": "s3://m/base", "gate_mode": "random",
              "experts": [{"source_model": "s3://m/a"}, {"source_model": "s3://m/b"}]}
RECIPE = {"merge_method": "linear", "models": [{"model": "s3://m/a"}, {"model": "s3://m/b"}]}


def test_the_request_union_is_discriminated_by_kind() -> None:
    assert type(parse_job_request({"recipe": RECIPE})) is JobRequest
    assert type(parse_job_request({"kind": "merge", "recipe": RECIPE})) is JobRequest
    moe = parse_job_request({"kind": "moe", "recipe": MOE_CONFIG, "name": "x"})
    assert isinstance(moe, MoeJobRequest) and moe == MoeJobRequest.of(MOE_CONFIG).model_copy(
        update={"name": "x"})
    for bad in ({"kind": "moe"}, {"kind": "moe", "recipe": MOE_CONFIG, "sweep": {}},
                {"kind": "moe", "method": "linear", "ability_donor": ["a"],
                 "language_base": "b"}, {"kind": "eval-only", "recipe": RECIPE}):
        with pytest.raises(ValidationError):
            parse_job_request(bad)


def _record(method: str, recipe: dict[str, object]) -> JobRecord:
    return JobRecord(id="j_1", owner="alice", method=method, recipe=recipe,
                     created_at="2026-01-01T00:00Z")


def test_each_registry_resolves_a_job_to_its_kind() -> None:
    merge = submission_of(parse_job_request({"recipe": RECIPE}))
    moe = submission_of(parse_job_request({"kind": "moe", "recipe": MOE_CONFIG}))
    assert (merge.method, moe.method) == ("linear", "moe")
    assert moe.warnings() == [] and moe.record_recipe()["base_model"] == "s3://m/base"
    assert record_kind(_record("moe", moe.record_recipe())).inputs(moe.record_recipe()) == (
        ["s3://m/base"], ["s3://m/a", "s3://m/b"])
    assert record_kind(_record("linear", RECIPE)).inputs(RECIPE) == (
        [], ["s3://m/a", "s3://m/b"])
    assert kind_of(_record("moe", moe.record_recipe())) is MOE
    assert kind_of(_record("linear", RECIPE)) is MERGE
    assert isinstance(MOE.plan(_record("moe", moe.record_recipe())), MoeJob)
    planned = MERGE.plan(_record("linear", merge.record_recipe()))
    assert isinstance(planned, MergeJob) and planned.spans == planned.plan.spans
