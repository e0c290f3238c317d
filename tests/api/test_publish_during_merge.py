"""Shards are uploaded while the merge goes on; the manifest only after every file is
stored and verified; a job that fails on the way leaves nothing published."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from app.jobs.worker_store import WorkerJobStore
from app.storage.base import Digest, StorageError, WaitFn
from app.storage.local import LocalStorage
from maec_core.io.writer import WrittenFile
from tests.api.conftest import Api
from worker.runner import JobRunner

SHARDED = {"shard_size": "16KB"}


class Recording(LocalStorage):
    """Local storage noting each upload, and whether the merge was still running then
    (its output folder appears only when the merge has finished)."""

    def __init__(self, root: Path, out: Path, fail_on: int | None = None) -> None:
        super().__init__(root)
        self.out = out
        self.fail_on = fail_on
        self.events: list[tuple[str, str, bool]] = []
        self.grown: list[str] = []  # uploaded while the writer was still appending

    def put_verified(self, key: str, f: BinaryIO, size: int, sha256: Digest, *,
                     wait_for: WaitFn | None = None) -> None:
        name = key.rsplit("/", 1)[-1]
        self.events.append(("verified", name, not self.out.exists()))
        if self.fail_on is not None and len(self.events) == self.fail_on:
            raise StorageError(f"injected: the store refused {key}", key=key)
        super().put_verified(key, f, size, sha256, wait_for=wait_for)
        if wait_for is not None:
            self.grown.append(name)

    def put_file(self, key: str, path: Path) -> None:
        self.events.append(("file", key.rsplit("/", 1)[-1], not self.out.exists()))
        super().put_file(key, path)


def _run(api: Api, storage: Recording, jid: str) -> str:
    return JobRunner(api.settings, api.worker_store(), storage, worker="test").run(jid)


def _job(api: Api, jid: str) -> dict[str, Any]:
    return dict(api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json())


def test_shards_upload_while_merging_and_manifest_is_last(api: Api) -> None:
    jid = str(api.submit(api.named(**SHARDED))["id"])
    storage = Recording(api.settings.storage_dir,
                        api.settings.work_dir / "jobs" / jid / "a1" / "out")
    assert _run(api, storage, jid) == "succeeded"
    job = _job(api, jid)
    shards = [f["path"] for f in job["result"]["files"]
              if f["path"].endswith(".safetensors")]
    assert len(shards) >= 3, shards
    during = [name for kind, name, merging in storage.events if merging]
    assert set(shards) <= set(during), "every shard went up before the merge ended"
    assert sorted(storage.grown) == sorted(shards), "each followed as it was written"
    assert storage.events[-1] == ("file", "manifest.json", False)
    assert [e for e in storage.events if e[1] == "manifest.json"] == [storage.events[-1]]
    for f in job["result"]["files"]:
        stored = storage.get_bytes(f"jobs/{jid}/a1/{f['path']}")
        assert len(stored) == f["size"]
        assert hashlib.sha256(stored).hexdigest() == f["sha256"], f["path"]


def test_a_failed_upload_mid_merge_publishes_nothing(api: Api) -> None:
    jid = str(api.submit(api.named(**SHARDED))["id"])
    storage = Recording(api.settings.storage_dir,
                        api.settings.work_dir / "jobs" / jid / "a1" / "out", fail_on=2)
    assert _run(api, storage, jid) == "failed"
    job = _job(api, jid)
    assert job["error"]["code"] == "storage_unavailable"
    assert storage.events[1][2], "the refused upload was a shard sent during the merge"
    assert not any(name == "manifest.json" for _, name, _ in storage.events)
    assert storage.list(f"jobs/{jid}/") == []


def test_local_put_verified_refuses_other_bytes(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "store")
    data = b"shard bytes" * 1000
    good = hashlib.sha256(data).hexdigest()
    store.put_verified("p/ok.bin", io.BytesIO(data), len(data), good)
    assert store.get_bytes("p/ok.bin") == data
    with pytest.raises(StorageError):
        store.put_verified("p/bad.bin", io.BytesIO(data[:-1] + b"X"), len(data), good)
    with pytest.raises(StorageError):
        store.put_verified("p/short.bin", io.BytesIO(data[:10]), len(data), good)
    assert [o.key for o in store.list("p/")] == ["p/ok.bin"]


def test_a_job_ended_by_its_claim_drops_a_dead_attempts_shards(api: Api) -> None:
    """A worker killed mid-merge leaves the shards it had uploaded; when the next claim
    ends the job (attempts exhausted), they are removed."""
    jid = str(api.submit(api.named())["id"])
    storage = api.storage()
    storage.put_bytes(f"jobs/{jid}/a1/model-00001-of-00003.safetensors", b"partial")
    api.r.hset(f"maec:job:{jid}", "attempts", str(api.settings.max_attempts))
    runner = JobRunner(api.settings, api.worker_store(), storage, worker="test")
    assert runner.run(jid) == "exhausted"
    assert storage.list(f"jobs/{jid}/") == []


class LoseLeaseAtPublish(WorkerJobStore):
    """The real store, but another attempt takes the job over as this one publishes."""

    def update(self, job_id: str, attempt: int, fields: dict[str, Any]) -> int:
        if fields.get("stage") == "publish":
            return -1
        return super().update(job_id, attempt, fields)


def test_an_attempt_taken_over_leaves_the_shards_it_recorded(api: Api) -> None:
    """The shards it uploaded are recorded as they land, and left for the attempt that
    took over to resume from (worker/resume.py); nothing else of it stays."""
    jid = str(api.submit(api.named(**SHARDED))["id"])
    storage = Recording(api.settings.storage_dir,
                        api.settings.work_dir / "jobs" / jid / "a1" / "out")
    runner = JobRunner(api.settings, LoseLeaseAtPublish(api.r), storage, worker="test")
    assert runner.run(jid) == "lost"
    assert any(merging for _, _, merging in storage.events), "shards went up mid-merge"
    rec = api.worker_store().get(jid)
    assert rec is not None and rec.shards is not None
    recorded = {f"{rec.shards['prefix']}/{name}" for name in rec.shards["files"]}
    assert recorded and {o.key for o in storage.list(f"jobs/{jid}/")} == recorded


def test_a_one_shard_output_uploads_while_it_is_written(api: Api) -> None:
    """The default shard size makes one shard of a small model: it still goes up part by
    part during the merge, and the stored bytes are the published ones."""
    jid = str(api.submit(api.named())["id"])
    storage = Recording(api.settings.storage_dir,
                        api.settings.work_dir / "jobs" / jid / "a1" / "out")
    assert _run(api, storage, jid) == "succeeded"
    assert storage.grown == ["model.safetensors"]
    assert ("verified", "model.safetensors", True) in storage.events
    f = {f["path"]: f for f in _job(api, jid)["result"]["files"]}["model.safetensors"]
    stored = storage.get_bytes(f"jobs/{jid}/a1/model.safetensors")
    assert hashlib.sha256(stored).hexdigest() == f["sha256"]


def test_local_put_verified_follows_a_growing_file(tmp_path: Path) -> None:
    """Bytes are read only once ``wait_for`` says they are written; the digest is asked
    for at the end."""
    store = LocalStorage(tmp_path / "store")
    data = os.urandom(20 * 2**20)
    path = tmp_path / "growing.bin"
    path.write_bytes(b"")
    asked: list[int] = []

    def wait_for(n: int) -> None:
        asked.append(n)
        with open(path, "ab") as out:  # the "writer" appends just what is asked for
            have = path.stat().st_size
            out.write(data[have:n])

    with open(path, "rb") as f:
        store.put_verified("g/file.bin", f, len(data),
                           lambda: hashlib.sha256(data).hexdigest(), wait_for=wait_for)
    assert store.get_bytes("g/file.bin") == data
    assert asked == sorted(asked) and asked[-1] == len(data) and len(asked) > 1


def test_a_shard_finished_between_size_check_and_end_check_is_not_short(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The upload reads the shard's size, then sees the shard ended. When the writer's
    last append and the end both land between the two reads, the size it holds is stale;
    the upload must look again rather than call a complete shard short."""
    from worker import publish

    path = tmp_path / "shard.safetensors"
    head, tail = b"h" * 100, b"t" * 28
    path.write_bytes(head)
    growing = publish._Growing("shard.safetensors", len(head) + len(tail))
    real_fstat = os.fstat
    calls = 0

    def fstat_then_finish(fd: int) -> os.stat_result:
        nonlocal calls
        calls += 1
        seen = real_fstat(fd)
        if calls == 1:
            # The writer's last append and its finish land right after this read.
            with open(path, "ab") as f:
                f.write(tail)
            growing.finish(WrittenFile("shard.safetensors", len(head) + len(tail),
                                       hashlib.sha256(head + tail).hexdigest()))
        return seen

    monkeypatch.setattr(publish.os, "fstat", fstat_then_finish)
    with open(path, "rb") as f:
        growing.wait_for(f.fileno(), len(head) + len(tail))
    assert calls >= 2


def test_a_shard_that_really_ended_short_is_refused(tmp_path: Path) -> None:
    from worker import publish

    path = tmp_path / "shard.safetensors"
    path.write_bytes(b"h" * 100)
    growing = publish._Growing("shard.safetensors", 128)
    growing.stop()
    with open(path, "rb") as f, pytest.raises(StorageError, match="ended at 100 of 128"):
        growing.wait_for(f.fileno(), 128)
