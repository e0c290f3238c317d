"""A job's published manifest accounts for every input tensor by reference; a job whose
plan would drop a tensor fails with ``tensor_unaccounted`` and publishes nothing."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from app.storage.local import LocalStorage
from tests.api.conftest import Api
from worker.runner import JobRunner


def _run(api: Api, jid: str) -> dict[str, Any]:
    runner = JobRunner(api.settings, api.worker_store(), LocalStorage(api.settings.storage_dir),
                       worker="test")
    runner.run(jid)
    return dict(api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json())


def test_a_jobs_accounting_names_inputs_by_reference(api: Api) -> None:
    job = _run(api, str(api.submit()["id"]))
    assert job["status"] == "succeeded", job["error"]
    manifest = job["result"]["manifest"]
    accounting = manifest["accounting"]
    assert set(accounting) == set(manifest["inputs"])
    for doc in accounting.values():
        assert doc["tensors"] == doc["merged"] + doc["copied"] + doc["folded"] + doc["left_out"]
        assert doc["merged"] == doc["tensors"]


def test_a_job_whose_plan_drops_a_tensor_fails_with_its_code(
        api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    import maec_core.method_plan as method_plan

    planner = method_plan.build_plan

    def drop(*args: Any, **kwargs: Any) -> Any:
        plan = planner(*args, **kwargs)
        return dataclasses.replace(plan, tensors=plan.tensors[1:])

    monkeypatch.setattr(method_plan, "build_plan", drop)
    jid = str(api.submit()["id"])
    job = _run(api, jid)
    assert job["status"] == "failed" and job["error"]["code"] == "tensor_unaccounted"
    assert job["error"]["details"]["tensors"] and job["result"] is None
    assert LocalStorage(api.settings.storage_dir).list(f"jobs/{jid}/") == []
