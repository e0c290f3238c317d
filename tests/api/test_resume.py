"""A MAEC job whose worker dies mid-merge resumes: the next attempt reuses the ability
artifact, verifies the shards the dead one recorded (a cut-short one is made again, not
trusted), makes only the others, and publishes an uninterrupted run's bytes."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from pathlib import Path
from typing import BinaryIO

import pytest

from app.jobs.keys import job_key
from app.storage.base import Digest, WaitFn
from app.storage.local import LocalStorage
from tests.api.conftest import Api
from worker.runner import JobRunner


class WorkerDied(BaseException):
    """The process is gone: nothing of the attempt runs after it (no record write)."""


class Shards(LocalStorage):
    """Local storage that keeps the shards it stored, and dies before the ``die_at``-th."""

    def __init__(self, root: Path, die_at: int | None = None) -> None:
        super().__init__(root)
        self.die_at = die_at
        self.stored: list[str] = []
        self._started = 0
        self._lock = threading.Lock()

    def put_verified(self, key: str, f: BinaryIO, size: int, sha256: Digest, *,
                     wait_for: WaitFn | None = None) -> None:
        shard = key.endswith(".safetensors")
        if shard:
            with self._lock:  # two uploads run at once: the count is taken as each starts
                self._started += 1
                if self.die_at is not None and self._started > self.die_at:
                    raise WorkerDied
        super().put_verified(key, f, size, sha256, wait_for=wait_for)
        if shard:
            with self._lock:
                self.stored.append(key.rsplit("/", 1)[1])


def test_maec_job_resumes_from_the_shards_a_dead_worker_recorded(api: Api) -> None:
    body = api.named("maec", shard_size="20KB")
    jid = str(api.submit(body)["id"])
    store = api.worker_store()
    dying = Shards(api.settings.storage_dir, die_at=3)
    with pytest.raises(WorkerDied):
        JobRunner(api.settings, store, dying, worker="dies").run(jid)
    rec = store.get(jid)
    assert rec is not None and rec.status == "running" and rec.shards is not None
    prefix, landed = rec.shards["prefix"], sorted(rec.shards["files"])
    assert landed == sorted(dying.stored) and len(landed) == 3
    # One recorded shard is cut short (a partial object): it must be made again.
    cut = api.settings.storage_dir / prefix / landed[0]
    cut.write_bytes(cut.read_bytes()[:-1])
    api.r.hset(job_key(jid), "lease_until", "0")  # the dead worker's lease has run out
    second = Shards(api.settings.storage_dir)
    assert JobRunner(api.settings, store, second, worker="next").run(jid) == "succeeded"
    job = api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json()
    assert job["attempts"] == 2 and job["artifact_reused"] is True
    assert job["progress"]["resumed"]["shards"] == len(landed) - 1
    done = store.get(jid)
    assert done is not None and done.result_prefix == prefix
    files = {f["path"]: f["sha256"] for f in job["result"]["files"]}
    shards = {p for p in files if p.endswith(".safetensors")}
    assert len(shards) > len(landed)
    assert sorted(second.stored) == sorted(shards - set(landed[1:]))
    # Byte for byte what an uninterrupted run of the same job publishes.
    whole = str(api.submit(body)["id"])
    _, manifest = api.run_published(whole)
    uninterrupted = api.client.get(f"/v1/jobs/{whole}", headers=api.auth()).json()
    assert files == {f["path"]: f["sha256"] for f in uninterrupted["result"]["files"]}
    for path, sha in files.items():
        data = (api.settings.storage_dir / prefix / path).read_bytes()
        assert hashlib.sha256(data).hexdigest() == sha, path
    stored = sorted(p.name for p in (api.settings.storage_dir / prefix).iterdir())
    assert stored == sorted(files)
    assert json.loads((api.settings.storage_dir / prefix / "manifest.json").read_bytes()
                      )["files"] == manifest["files"]


def test_a_resumed_merge_on_an_empty_cache_fetches_only_what_its_shards_left_read(
        api: Api, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="maec.worker")
    body = api.named("ties", shard_size="20KB")
    jid = str(api.submit(body)["id"])
    store = api.worker_store()
    dying = Shards(api.settings.storage_dir, die_at=3)
    with pytest.raises(WorkerDied):
        JobRunner(api.settings, store, dying, worker="dies").run(jid)
    api.r.hset(job_key(jid), "lease_until", "0")
    # Another node: its own, empty cache.
    node = api.settings.model_copy(update={"work_dir": tmp_path / "node2"})
    caplog.clear()
    assert JobRunner(node, store, Shards(api.settings.storage_dir), worker="next"
                     ).run(jid) == "succeeded"
    fetched = [int(n) for n in re.findall(rf"job {jid}: inputs ready \((\d+) bytes fetched",
                                          caplog.text)]
    inputs = sum(f.stat().st_size for m in (api.models.base, api.models.donor,
                                            api.models.lang) for f in Path(m).iterdir())
    job = api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json()
    shards = [p for p in job["result"]["files"] if p["path"].startswith("model-")]
    left = 1 - job["progress"]["resumed"]["shards"] / len(shards)
    assert len(fetched) == 1 and 0 < fetched[0] < inputs * min(1.0, left + 0.15)
    # The same bytes as an uninterrupted run, input digests included.
    whole = str(api.submit(body)["id"])
    api.run_published(whole)
    uninterrupted = api.client.get(f"/v1/jobs/{whole}", headers=api.auth()).json()
    assert ({f["path"]: f["sha256"] for f in job["result"]["files"]}
            == {f["path"]: f["sha256"] for f in uninterrupted["result"]["files"]})
    assert (job["result"]["manifest"]["inputs"]
            == uninterrupted["result"]["manifest"]["inputs"])


def test_a_record_naming_another_prefix_is_not_taken_over(api: Api) -> None:
    """Only an attempt prefix of the job itself is resumed from: a record naming any
    other storage path starts afresh under its own, and leaves that path alone."""
    jid = str(api.submit(api.named(shard_size="20KB"))["id"])
    other = api.settings.storage_dir / "elsewhere"
    other.mkdir(parents=True)
    (other / "model-00001-of-00006.safetensors").write_bytes(b"not ours")
    api.r.hset(job_key(jid), "shards", json.dumps({"prefix": "elsewhere", "files": {
        "model-00001-of-00006.safetensors": {"size": 8, "sha256": "0" * 64}}}))
    storage = Shards(api.settings.storage_dir)
    assert JobRunner(api.settings, api.worker_store(), storage, worker="w").run(jid) == "succeeded"
    rec = api.worker_store().get(jid)
    assert rec is not None and rec.result_prefix == f"jobs/{jid}/a1"
    assert "resumed" not in rec.progress.model_dump()
    assert len(storage.stored) > 1
    assert (other / "model-00001-of-00006.safetensors").read_bytes() == b"not ours"
