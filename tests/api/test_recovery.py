"""Recovery paths: lease sweeping, time limits, rate limits, Redis outages."""

from __future__ import annotations

import shutil
import time
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded

from app.jobs.keys import ORPHANS_KEY
from app.jobs.worker_store import WorkerJobStore
from app.queue import QUEUE
from app.storage.base import StorageError
from app.storage.local import LocalStorage
from tests.api.conftest import Api
from worker.runner import JobRunner
from worker.sweeper import sweep_expired


def test_sweeper_requeues_jobs_whose_worker_died(api: Api) -> None:
    store = api.worker_store()
    jid = str(api.submit()["id"])
    api.r.delete(QUEUE)  # the original message was consumed by the worker that died
    store.claim(jid, worker="dead", lease_s=0.05, max_attempts=3)
    live = str(api.submit()["id"])
    store.claim(live, worker="alive", lease_s=60, max_attempts=3)
    api.r.delete(QUEUE)
    time.sleep(0.1)
    celery = Celery("t", broker=api.settings.redis_url, set_as_current=False)
    celery.conf.update(task_serializer="json")
    assert sweep_expired(store, celery, api.settings) == [jid]
    assert api.r.llen(QUEUE) == 1
    # Another worker sweeping at the same moment does not enqueue it again.
    assert sweep_expired(store, celery, api.settings) == []
    # The redelivery takes the job over as attempt 2 and finishes it.
    runner = JobRunner(api.settings, store, LocalStorage(api.settings.storage_dir))
    assert runner.run(jid) == "succeeded"
    rec = store.get(jid)
    assert rec is not None and rec.attempts == 2 and rec.worker != "dead"


class TimesOut(WorkerJobStore):
    """Celery's soft time limit firing in the middle of the merge."""

    def update(self, job_id: str, attempt: int, fields: dict[str, Any]) -> int:
        if fields.get("stage") == "combine":
            raise SoftTimeLimitExceeded()
        return super().update(job_id, attempt, fields)


def test_soft_time_limit_fails_the_job_cleanly(api: Api) -> None:
    jid = str(api.submit()["id"])
    runner = JobRunner(api.settings, TimesOut(api.r), LocalStorage(api.settings.storage_dir))
    assert runner.run(jid) == "failed"
    job = api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json()
    assert job["error"]["code"] == "time_limit"
    assert not (api.settings.work_dir / "jobs" / jid / "a1").exists()


def test_submissions_are_rate_limited_per_key(api_factory: Any) -> None:
    api: Api = api_factory(submissions_per_minute=2)
    if int(time.time()) % 60 > 57:
        time.sleep(3)  # stay inside one window
    api.submit()
    api.submit()
    r = api.client.post("/v1/jobs", json=api.named(), headers=api.auth())
    assert r.status_code == 429 and r.json()["code"] == "rate_limited"
    assert 0 < int(r.headers["retry-after"]) <= 60
    assert api.client.post("/v1/jobs", json=api.named(), headers=api.auth("bob")
                           ).status_code == 202


def test_idempotent_replay_survives_changed_sources(api: Api) -> None:
    donor = api.root / "extra" / "donor"
    shutil.copytree(api.models.donor, donor)
    body = api.named(ability_donor=[str(donor)], idempotency_key="replay")
    first = api.client.post("/v1/jobs", json=body, headers=api.auth())
    shutil.rmtree(donor)
    again = api.client.post("/v1/jobs", json=body, headers=api.auth())
    assert (first.status_code, again.status_code) == (202, 200)
    assert again.json()["id"] == first.json()["id"]


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/jobs/j_01"])
def test_redis_outage_is_503(api_factory: Any, path: str) -> None:
    api: Api = api_factory(redis_url="redis://127.0.0.1:1/0")
    r = api.client.get(path, headers=api.auth())
    assert r.status_code == 503 and r.json()["code"] == "unavailable"
    assert api.client.get("/healthz").status_code == 200
    ready = api.client.get("/readyz", headers=api.auth())
    assert ready.status_code == 503 and ready.json()["redis"] is False


class StoreDown(LocalStorage):
    """The object store while it is unreachable: every deletion fails."""

    def delete_prefix(self, prefix: str) -> None:
        raise StorageError("the store is down")


def test_orphaned_staging_is_removed_once_the_store_answers(api: Api) -> None:
    store, storage = api.worker_store(), api.storage()
    storage.put_bytes("jobs/j_1/a1/model.safetensors", b"x")
    storage.put_bytes("jobs/j_2/a1/keep.json", b"{}")
    store.remember_orphan("jobs/j_1/a1/")
    # Still down at the next heartbeat: nothing is removed or forgotten.
    assert store.clean_orphans(StoreDown(api.settings.storage_dir)) == []
    assert api.r.smembers(ORPHANS_KEY) == {b"jobs/j_1/a1/"}
    assert store.clean_orphans(storage) == ["jobs/j_1/a1/"]
    assert storage.list("jobs/j_1/") == [] and api.r.scard(ORPHANS_KEY) == 0
    assert [o.key for o in storage.list("jobs/")] == ["jobs/j_2/a1/keep.json"]
    # Redis down too: remembering is best effort and never raises.
    WorkerJobStore.from_url("redis://127.0.0.1:1/0").remember_orphan("jobs/j_3/a1/")


def test_a_failed_cleanup_is_remembered_by_the_runner(api: Api) -> None:
    jid = str(api.submit()["id"])
    runner = JobRunner(api.settings, TimesOut(api.r), StoreDown(api.settings.storage_dir))
    assert runner.run(jid) == "failed"
    assert api.r.smembers(ORPHANS_KEY) == {f"jobs/{jid}/a1/".encode()}
