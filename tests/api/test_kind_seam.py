"""The job-kind seam: a kind defined here (``copy``: publishes one file of its input
checkpoint as it is) and registered at runtime in the two registries, by its name, runs
end to end: its request read by its submission, the record run by the shared runner,
its file published and served like any job's. Nothing else of the service knows it."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest

from app import kinds as app_kinds
from app.jobs.api_store import ApiJobStore
from app.jobs.record import JobRecord, new_job_id, now_iso
from app.scheduler.estimate import Need
from app.settings import Settings
from app.sources import Published, parse_source, pin_source
from app.storage.base import Storage
from maec_contract import KindRequest
from maec_core.service import FileEntry, Manifest, StageSpans, job_spans, sha256_file
from tests.api.conftest import Api
from tests.ui.test_pages import _login
from worker import kinds as worker_kinds
from worker.job_kind import Made, Run

KIND = "copy"
FILE = "config.json"


class CopyRequest(KindRequest):
    KIND: ClassVar[str] = KIND
    RECIPE_DOC: ClassVar[str] = "{source}: the checkpoint whose config.json to publish"
    kind: Literal["copy"]


@dataclass(frozen=True)
class CopySubmission:
    source: str

    @property
    def method(self) -> str:
        return KIND

    @property
    def name(self) -> str | None:
        return None

    def record_recipe(self) -> dict[str, Any]:
        return {"source": self.source}

    def warnings(self) -> list[str]:
        return []

    def references(self) -> set[str]:
        return set()

    def check_sources(self, settings: Settings, storage: Storage,
                      outputs: Mapping[str, Published] | None = None
                      ) -> tuple[dict[str, dict[str, Any]], Need, list[str]]:
        pinned = pin_source(parse_source(self.source, settings, outputs), storage)
        return {self.source: pinned.to_dict()}, Need(0, 0, 0), []


class CopyKind:
    def owns(self, method: str) -> bool:
        return method == KIND

    def inputs(self, recipe: dict[str, Any]) -> tuple[list[str], list[str]]:
        return [str(recipe["source"])], []

    def submission(self, req: CopyRequest) -> CopySubmission:
        return CopySubmission(str(req.recipe["source"]))


@dataclass(frozen=True)
class CopyJob:
    source: str

    @property
    def spans(self) -> StageSpans:
        return job_spans(extracts=False, evaluates=False)

    @property
    def resumable(self) -> bool:
        return False

    def one_file(self, ref: str) -> bool:
        return False

    def check(self, local: Mapping[str, str]) -> None:
        pass

    def produce(self, run: Run) -> Made:
        run.out.mkdir(parents=True, exist_ok=True)
        out = run.out / FILE
        shutil.copyfile(Path(run.local[self.source]) / FILE, out)
        entry = FileEntry(FILE, out.stat().st_size, sha256_file(out))
        doc = {"kind": KIND, "inputs": [self.source], "files": [entry.to_json()]}
        return Made(Manifest.of(doc), {"copied": FILE}, 0.0)


class CopyJobKind:
    def plan(self, rec: JobRecord) -> CopyJob:
        return CopyJob(str(rec.recipe["source"]))


@pytest.fixture
def copy_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``copy`` kind in the API's and the worker's registries, by its name."""
    monkeypatch.setitem(app_kinds.KINDS, KIND, CopyKind())
    monkeypatch.setitem(worker_kinds.KINDS, KIND, CopyJobKind())


def _submit(api: Api, body: CopyRequest) -> str:
    """What ``POST /v1/jobs`` does with a body of a registered kind: its submission
    from the registry, its sources checked, the record queued."""
    job = app_kinds.submission_of(body)
    sources, need, notes = job.check_sources(api.settings, api.storage())
    record = JobRecord(id=new_job_id(), owner="alice", method=job.method, name=job.name,
                       recipe=job.record_recipe(), warnings=job.warnings() + notes,
                       sources=sources, created_at=now_iso(), estimate=need.to_dict())

    async def create() -> str:
        store = ApiJobStore.from_url(api.settings.redis_url)
        try:
            outcome, job_id = await store.create(record, max_active=10, weights={})
        finally:
            await store.close()
        assert outcome == "created", outcome
        return job_id

    return asyncio.run(create())


@pytest.mark.usefixtures("copy_kind")
def test_a_kind_registered_at_runtime_runs_end_to_end(api: Api) -> None:
    source = str(api.models.base)
    jid = _submit(api, CopyRequest(kind="copy", recipe={"source": source}))
    rec = api.worker_store().get(jid)
    assert rec is not None and app_kinds.kind_name(rec) == KIND
    assert isinstance(worker_kinds.kind_of(rec), CopyJobKind)
    urls, manifest = api.run_published(jid)
    assert set(urls) == {FILE, "manifest.json"}
    assert manifest["kind"] == KIND and manifest["inputs"] == [source]
    served = api.client.get(urls[FILE], headers=api.auth()).content
    want = (api.models.base / FILE).read_bytes()
    assert hashlib.sha256(served).digest() == hashlib.sha256(want).digest()
    job = api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json()
    assert job["method"] == KIND and job["result"]["report"] == {"copied": FILE}
    # The job pages read the kind's inputs through the same registry.
    _login(api)
    page = api.client.get(f"/ui/jobs/{jid}")
    assert page.status_code == 200 and source in page.text


def test_a_record_no_registered_kind_owns_is_the_default_kinds() -> None:
    rec = JobRecord(id=new_job_id(), owner="alice", method=KIND, recipe={},
                    created_at=now_iso())
    assert app_kinds.kind_name(rec) == app_kinds.DEFAULT == "merge"
    assert worker_kinds.kind_of(rec) is worker_kinds.KINDS["merge"]
