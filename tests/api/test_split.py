"""A merge above the pool's split size runs as parts (contiguous shard groups) on several
workers, then a final step writes the index, card and manifest once: the result is the
unsplit merge's byte for byte. A part whose worker dies is claimed again once its lease
runs out and resumes from the shards it recorded; a cancel stops every part."""

from __future__ import annotations

import hashlib
import itertools
import logging
import multiprocessing
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import pytest
import redis

from app.jobs.keys import job_key, usage_key
from app.jobs.parts import part_ranges, parts_key
from app.jobs.worker_store import WorkerJobStore
from app.storage.base import Digest, StorageError, WaitFn
from app.storage.local import LocalStorage
from tests.api.conftest import Api
from tests.api.test_resume import Shards, WorkerDied
from tests.stack import RedisServer
from worker import drain, split
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


class Watched(WorkerJobStore):
    """The job store, noting every progress fraction written to a record, in order."""

    def __init__(self, client: redis.Redis, seen: list[float], lock: threading.Lock
                 ) -> None:
        super().__init__(client)
        self.seen = seen
        self.lock = lock

    def update(self, job_id: str, attempt: int, fields: dict[str, Any]) -> int:
        with self.lock:  # in the order Redis applied them
            flag = super().update(job_id, attempt, fields)
            if "progress" in fields:
                self.seen.append(float(fields["progress"]["fraction"]))
        return flag


class Slow(Shards):
    """Shards that take a while to store, so the job's progress is read between them."""

    def put_verified(self, key: str, f: BinaryIO, size: int, sha256: Digest, *,
                     wait_for: WaitFn | None = None) -> None:
        time.sleep(0.1)
        super().put_verified(key, f, size, sha256, wait_for=wait_for)


def test_a_split_jobs_progress_only_grows_to_one_and_its_webhook_is_handed_on_once(
        api_factory: Callable[..., Api]) -> None:
    """As for a whole job: the progress a reader sees never goes back, even when a part
    whose worker died is run again from its start, and ends at 1.0; the finished job is
    handed to the webhook once (by its own attempt, never by a helper)."""
    api = api_factory(split_above_bytes=1, split_parts=2, lease_seconds=2,
                      progress_interval=0.0, webhook_allowed_hosts=["127.0.0.1"],
                      webhook_secrets={"alice": "whsec-0123456789abcdef"})
    jid = str(api.submit(api.named(callback_url="http://127.0.0.1/hook", **BODY))["id"])
    seen: list[float] = []
    lock = threading.Lock()
    ended: list[str] = []

    def runner(name: str, storage: Shards, **kw: Any) -> JobRunner:
        return JobRunner(api.settings, Watched(api.r, seen, lock), storage, worker=name,
                         on_finished=ended.append, **kw)

    died: list[bool] = []

    def send_part(job: str) -> None:
        # The helper's worker dies after its part's first shard landed.
        try:
            help_parts(runner("dies", Slow(api.settings.storage_dir, die_at=1)), job)
        except WorkerDied:
            died.append(True)

    helpers: list[threading.Thread] = []

    def start_helper(job: str) -> None:
        helpers.append(threading.Thread(target=send_part, args=(job,)))
        helpers[-1].start()

    coordinator = runner("coordinator", Slow(api.settings.storage_dir),
                         send_part=start_helper, split=coordinate)
    assert coordinator.run(jid) == "succeeded"
    for t in helpers:
        t.join(30)
    assert died == [True] and ended == [jid]
    assert seen[-1] == 1.0 and len(set(seen)) > 5, seen
    assert all(a <= b for a, b in itertools.pairwise(seen)), seen
    job = api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json()
    assert job["progress"]["fraction"] == 1.0 and job["attempts"] == 1


def test_a_parts_progress_never_goes_back_when_it_is_claimed_again(api: Api) -> None:
    parts = api.worker_store().parts()
    parts.create("j", "jobs/j/a1", [(0, 2), (2, 4)])
    i, first = parts.claim("j", worker="w1", lease_s=30, now=time.time(), max_attempts=3)
    assert parts.update("j", i, first, {"fraction": 0.6})
    # w1 died: its lease ran out and w2 runs the part again, counting from its start.
    i2, second = parts.claim("j", worker="w2", lease_s=30, now=time.time() + 60,
                             max_attempts=3)
    assert (i2, second) == (i, 2)
    assert parts.update("j", i, second, {"fraction": 0.1})
    state = parts.get("j")
    assert state is not None and state.fraction == pytest.approx(0.3)
    assert parts.update("j", i, second, {"fraction": 0.8})
    assert parts.get("j").fraction == pytest.approx(0.4)  # type: ignore[union-attr]
    assert parts.finish("j", i, second) and parts.finish("j", i, second)  # retried: kept
    assert not parts.finish("j", i, first)  # the old holder records nothing


class DrainAt(LocalStorage):
    """Local storage that starts the worker's drain as the first shard is stored."""

    def __init__(self, root: Path, drain: threading.Event) -> None:
        super().__init__(root)
        self.drain = drain

    def put_verified(self, key: str, f: BinaryIO, size: int, sha256: Digest, *,
                     wait_for: WaitFn | None = None) -> None:
        if key.endswith(".safetensors"):
            self.drain.set()
        super().put_verified(key, f, size, sha256, wait_for=wait_for)


def test_a_draining_helper_finishes_its_part_and_takes_no_other(
        api_factory: Callable[..., Api], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The helper's worker starts draining (SIGTERM) while it runs a part: that part is
    finished and marked done there, no other part is taken, and the job's own attempt
    runs the parts left."""
    caplog.set_level(logging.INFO, logger="maec.worker")
    drain = threading.Event()
    monkeypatch.setattr(split, "draining", drain.is_set)
    api = api_factory(split_above_bytes=1, split_parts=3)
    jid = str(api.submit(api.named(**BODY))["id"])
    ran: list[str] = []

    def send_part(job: str) -> None:
        if not ran:  # the first helper; the second's message waits on the drained worker
            ran.append(help_parts(JobRunner(api.settings, api.worker_store(),
                                            DrainAt(api.settings.storage_dir, drain),
                                            worker="drained"), job))

    coordinator = JobRunner(api.settings, api.worker_store(), api.storage(),
                            worker="coordinator", send_part=send_part, split=coordinate)
    assert coordinator.run(jid) == "succeeded"
    assert ran == ["ran 1 parts, draining"]
    done = [line for line in caplog.text.splitlines() if f"job {jid}: part " in line
            and line.endswith(" done")]
    assert len(done) == 3
    assert _files(api, jid) == _whole(api)


def _wait_for_drain() -> None:
    deadline = time.monotonic() + 20
    while not drain.draining():
        if time.monotonic() > deadline:
            sys.exit(1)
        time.sleep(0.01)
    sys.exit(0)


def test_a_drain_reaches_the_pool_children_forked_before_it() -> None:
    """Celery's shutdown signal sets the drain in the worker's main process; a split
    job's helper asks in its pool child, forked before that."""
    child = multiprocessing.get_context("fork").Process(target=_wait_for_drain)
    child.start()
    try:
        time.sleep(0.2)
        assert child.is_alive()
        drain._draining.set()  # what the shutdown signal's handler does first
        child.join(25)
        assert child.exitcode == 0
    finally:
        drain._draining.clear()  # this test process is no draining worker
        if child.is_alive():
            child.kill()


def test_a_split_jobs_result_is_kept_pinned_and_removed_like_a_whole_jobs(
        api_factory: Callable[..., Api]) -> None:
    """Pin, expiry, delete and the storage quota see a split job as a whole one: its
    files under the job's prefix, its bytes counted once; removing it removes its files
    and its parts' state (left behind when its end could not remove it)."""
    api = api_factory(split_above_bytes=1, split_parts=2)
    jobs = {}
    for pinned in (True, False):
        jid = str(api.submit(api.named(pinned=pinned, **BODY))["id"])
        assert JobRunner(api.settings, api.worker_store(), api.storage(),
                         split=coordinate).run(jid) == "succeeded"
        jobs[pinned] = api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json()
    kept, gone = jobs[True]["id"], jobs[False]["id"]
    size = {p: sum(f["size"] for f in j["result"]["files"]) for p, j in jobs.items()}
    assert int(api.r.get(usage_key("alice")) or 0) == size[True] + size[False]
    for jid in (kept, gone):  # as an end whose clean-up Redis refused leaves them
        api.worker_store().parts().create(jid, f"jobs/{jid}/a1", [(0, 1), (1, 2)])
    store, storage = api.worker_store(), api.storage()
    assert store.expire_jobs(storage, older_than_s=0) == [gone]
    outputs = Path(api.settings.storage_dir) / "jobs"
    assert not (outputs / gone).exists() and not api.r.exists(parts_key(gone))
    assert (outputs / kept).is_dir() and api.r.exists(parts_key(kept))
    assert int(api.r.get(usage_key("alice")) or 0) == size[True]
    assert api.client.delete(f"/v1/jobs/{kept}", headers=api.auth()).status_code == 204
    assert not (outputs / kept).exists() and not api.r.exists(parts_key(kept))
    assert api.r.get(usage_key("alice")) is None


def test_the_workers_store_waits_out_a_redis_restart(tmp_path: Path) -> None:
    """A worker's calls (a part's claim, its lease, the job's cancel flag) made while
    Redis restarts wait for it rather than fail the part; what was written before is
    there after (AOF, as deploy/redis.conf runs it)."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        store = WorkerJobStore.from_url(server.url)
        parts = store.parts()
        parts.create("j", "jobs/j/a1", [(0, 1), (1, 2)])
        server.stop()
        back = threading.Timer(1.0, server.start)
        back.start()
        try:
            # Sent while the server is down: refused, retried, answered once it is up.
            claimed = parts.claim("j", worker="w", lease_s=30, now=time.time(),
                                  max_attempts=3)
        finally:
            back.join()
        assert claimed == (0, 1)
        store.close()
    finally:
        server.stop()
