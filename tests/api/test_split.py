"""A merge above the pool's split size runs as parts (contiguous shard groups) on several
workers, then a final step writes the index, card and manifest once: the result is the
unsplit merge's byte for byte. A part whose worker dies is claimed again once its lease
runs out and resumes from the shards it recorded; a cancel stops every part."""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import pytest

from app.jobs.keys import job_key
from app.jobs.parts import part_ranges, parts_key
from app.storage.base import Digest, StorageError, WaitFn
from app.storage.local import LocalStorage
from tests.api.conftest import Api
from tests.api.test_resume import Shards, WorkerDied
from worker.runner import JobRunner
from worker.split import coordinate, help_parts

BODY = {"shard_size": "20KB"}


def _files(api: Api, jid: str) -> dict[str, str]:
    job = api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json()
    assert job["status"] == "succeeded", job
    return {f["path"]: f["sha256"] for f in job["result"]["files"]}


def _whole(api: Api) -> dict[str, str]:
    """The same merge run unsplit."""
    jid = str(api.submit(api.named(**BODY))["id"])
    settings = api.settings.model_copy(update={"split_above_bytes": 0})
    assert JobRunner(settings, api.worker_store(), api.storage()).run(jid) == "succeeded"
    return _files(api, jid)


def test_part_ranges_are_contiguous_and_cover_the_plan() -> None:
    assert part_ranges(7, 3) == [(0, 2), (2, 5), (5, 7)]
    assert part_ranges(2, 4) == [(0, 1), (1, 2)]


def test_split_job_runs_its_parts_on_several_workers_and_publishes_the_whole(
        api_factory: Callable[..., Api], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="maec.worker")
    api = api_factory(split_above_bytes=1, split_parts=3)
    jid = str(api.submit(api.named(**BODY))["id"])
    helpers: list[threading.Thread] = []
    ran: list[str] = []

    def send_part(job: str) -> None:
        runner = JobRunner(api.settings, api.worker_store(), api.storage(),
                           worker=f"helper{len(helpers)}")
        t = threading.Thread(target=lambda: ran.append(help_parts(runner, job)))
        helpers.append(t)
        t.start()

    coordinator = JobRunner(api.settings, api.worker_store(), api.storage(),
                            worker="coordinator", send_part=send_part, split=coordinate)
    assert coordinator.run(jid) == "succeeded"
    for t in helpers:
        t.join(30)
    assert len(helpers) == 2 and len(ran) == 2
    assert f"job {jid}: split into 3 parts" in caplog.text
    assert caplog.text.count(f"job {jid}: part ") >= 6  # each part begun and done once
    for i in range(3):
        assert caplog.text.count(f"job {jid}: part {i} done") == 1
    # Each part fetched only the byte ranges its shards read: together every input
    # tensor once, each part about a third of them.
    fetched = [int(n) for n in re.findall(rf"job {jid}: part \d fetched (\d+) bytes",
                                          caplog.text)]
    weights = sum(f.stat().st_size for m in (api.models.base, api.models.donor,
                                             api.models.lang)
                  for f in Path(m).glob("*.safetensors"))
    assert len(fetched) == 3 and all(0 < n < weights / 2 for n in fetched)
    assert sum(fetched) <= weights
    files = _files(api, jid)
    assert "model.safetensors.index.json" in files
    assert files == _whole(api)
    # The manifest names each input file's sha256, though no worker held one whole.
    manifest = api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json()["result"][
        "manifest"]
    assert len(manifest["inputs"]) == 3
    for ref, doc in manifest["inputs"].items():
        for name, sha in doc["files"].items():
            assert sha == hashlib.sha256((Path(ref) / name).read_bytes()).hexdigest()
    assert not api.r.exists(parts_key(jid))  # gone with the ended job
    job = api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json()
    assert job["progress"]["fraction"] == 1.0 and job["attempts"] == 1


def test_a_part_whose_worker_dies_is_claimed_again_and_resumes(
        api_factory: Callable[..., Api], tmp_path: Path) -> None:
    api = api_factory(split_above_bytes=1, split_parts=2, lease_seconds=2)
    jid = str(api.submit(api.named(**BODY))["id"])
    dying = Shards(api.settings.storage_dir, die_at=1)
    died: list[bool] = []

    def send_part(job: str) -> None:
        # The helper takes part 0 first and its worker dies after one shard landed.
        try:
            help_parts(JobRunner(api.settings, api.worker_store(), dying, worker="dies"),
                       job)
        except WorkerDied:
            died.append(True)

    second = Shards(api.settings.storage_dir)
    coordinator = JobRunner(api.settings, api.worker_store(), second,
                            worker="coordinator", send_part=send_part, split=coordinate)
    assert coordinator.run(jid) == "succeeded"
    assert died == [True] and len(dying.stored) == 1
    files = _files(api, jid)
    # The dead part's recorded shard was verified and kept, not made again.
    assert dying.stored[0] not in second.stored
    assert sorted(second.stored) == sorted(
        p for p in files if p.endswith(".safetensors") and p != dying.stored[0])
    assert files == _whole(api)


def test_cancel_stops_a_split_job_and_leaves_nothing(
        api_factory: Callable[..., Api]) -> None:
    api = api_factory(split_above_bytes=1, split_parts=2)
    jid = str(api.submit(api.named(**BODY))["id"])

    def send_part(job: str) -> None:
        r = api.client.post(f"/v1/jobs/{job}/cancel", headers=api.auth())
        assert r.status_code in (200, 202), r.text

    coordinator = JobRunner(api.settings, api.worker_store(), api.storage(),
                            worker="coordinator", send_part=send_part, split=coordinate)
    assert coordinator.run(jid) == "cancelled"
    assert not api.r.exists(parts_key(jid))
    assert not list((api.settings.storage_dir / "jobs" / jid).rglob("*.safetensors"))


class Refusing(LocalStorage):
    """Local storage that refuses the first ``refuse`` shard uploads (an outage), and
    can ask for the job's cancel as the final step uploads its first small file."""

    def __init__(self, root: Path, refuse: int = 0,
                 on_final: Callable[[], None] | None = None) -> None:
        super().__init__(root)
        self.refuse = refuse
        self.on_final = on_final
        self._lock = threading.Lock()

    def put_verified(self, key: str, f: BinaryIO, size: int, sha256: Digest, *,
                     wait_for: WaitFn | None = None) -> None:
        if key.endswith(".safetensors"):
            with self._lock:
                self.refuse -= 1
                if self.refuse >= 0:
                    raise StorageError(f"{key}: the store is unreachable")
        elif self.on_final is not None:
            self.on_final()
            self.on_final = None
        super().put_verified(key, f, size, sha256, wait_for=wait_for)


def test_a_part_whose_upload_the_store_refuses_for_a_while_is_tried_again(
        api_factory: Callable[..., Api]) -> None:
    api = api_factory(split_above_bytes=1, split_parts=2)
    jid = str(api.submit(api.named(**BODY))["id"])
    storage = Refusing(api.settings.storage_dir, refuse=2)
    runner = JobRunner(api.settings, api.worker_store(), storage, split=coordinate)
    assert runner.run(jid) == "succeeded"
    assert storage.refuse < 0
    assert _files(api, jid) == _whole(api)


def test_cancel_during_the_final_step_publishes_nothing(
        api_factory: Callable[..., Api]) -> None:
    api = api_factory(split_above_bytes=1, split_parts=2, cancel_poll_interval=0.0)
    jid = str(api.submit(api.named(**BODY))["id"])

    def cancel() -> None:
        r = api.client.post(f"/v1/jobs/{jid}/cancel", headers=api.auth())
        assert r.status_code in (200, 202), r.text

    storage = Refusing(api.settings.storage_dir, on_final=cancel)
    runner = JobRunner(api.settings, api.worker_store(), storage, split=coordinate)
    assert runner.run(jid) == "cancelled"
    assert storage.on_final is None  # the parts were done: the final step had begun
    assert not api.r.exists(parts_key(jid))
    assert not [p for p in (api.settings.storage_dir / "jobs" / jid).rglob("*")
                if p.is_file()]


def test_a_lost_coordinator_is_followed_by_one_that_keeps_the_parts(
        api_factory: Callable[..., Api]) -> None:
    api = api_factory(split_above_bytes=1, split_parts=2, lease_seconds=2)
    jid = str(api.submit(api.named(**BODY))["id"])
    dying = Shards(api.settings.storage_dir, die_at=1)
    with pytest.raises(WorkerDied):
        JobRunner(api.settings, api.worker_store(), dying, worker="dies",
                  split=coordinate).run(jid)
    assert len(dying.stored) == 1
    api.r.hset(job_key(jid), "lease_until", "0")  # the dead worker's lease has run out
    second = Shards(api.settings.storage_dir)
    assert JobRunner(api.settings, api.worker_store(), second, worker="next",
                     split=coordinate).run(jid) == "succeeded"
    files = _files(api, jid)
    assert dying.stored[0] not in second.stored  # its part's recorded shard was kept
    assert files == _whole(api)
