"""A merge that resumes where a lost attempt stopped: its published shards are kept.

A merge's output shards are a fixed list (the engine's shard plan: the output tensors in
order, cut at ``out_shard_size``), and each is uploaded while the merge goes on. Each
shard is recorded in the job's record as it lands (:class:`ShardLedger`: name, size,
sha256 and the stored object's ETag, written through the attempt-checked update, so a
worker whose lease was taken over records nothing), together with the storage prefix the
shards lie under.

The next attempt after a lost or drained worker (:func:`adopt`) takes that prefix over
instead of starting a fresh one: it verifies every recorded shard against the stored
object (its size, and its sha256: the store's own when it keeps one; else the object
is the one stored then when its ETag is unchanged; else its bytes are hashed as they are
read back), keeps those that match and hands them to the engine
as done (``EngineOptions.done_shards``), which then neither reads nor computes their
tensors. Anything else under the prefix (a shard that does not match, one uploaded but
never recorded, a partial upload) is made and uploaded again over it. The files beside
the shards and the manifest, last, are written as in any attempt, so the result is an
uninterrupted run's byte for byte.

A prefix the record names is never removed by an attempt that lost its lease (its
successor is using it: :func:`in_use`); it goes with the job, like any attempt's.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from app.jobs.record import JobRecord
from app.jobs.worker_store import WorkerJobStore
from app.storage.base import Storage, StorageError
from maec_core.service import JobPlan
from maec_core.service.running import WrittenFile

log = logging.getLogger("maec.worker")

# The job record's field holding the published shards: {"prefix", "files": {name:
# {"size", "sha256", "etag"}}}.
FIELD = "shards"


def resumable(plan: JobPlan | None) -> bool:
    """Whether the job's output can be resumed: a plain merge's. A sweep's output is
    chosen among candidates, and an evaluated merge reads its whole output folder back."""
    return (plan is not None and plan.recipe.sweep is None
            and not plan.recipe.evaluate)


@dataclass(frozen=True)
class Landed:
    """A shard as recorded when it landed: its file, and the stored object's ETag then
    (None when the store did not say)."""

    file: WrittenFile
    etag: str | None = None


def recorded(rec: JobRecord) -> tuple[str, dict[str, Landed]] | None:
    """The record's published shards: (prefix, name -> shard), or None."""
    doc = rec.shards
    if not doc or not isinstance(doc.get("prefix"), str):
        return None
    files = {name: Landed(WrittenFile(name, int(f["size"]), str(f["sha256"])),
                          str(f["etag"]) if f.get("etag") else None)
             for name, f in (doc.get("files") or {}).items()}
    return str(doc["prefix"]), files


def in_use(store: WorkerJobStore, job_id: str, prefix: str) -> bool:
    """Whether the job's record names ``prefix`` as its published shards' (an attempt
    that lost its lease then leaves it to the one that took over)."""
    rec = store.get(job_id)
    found = recorded(rec) if rec is not None else None
    return found is not None and found[0] == prefix


def stored_sha256(storage: Storage, key: str, shard: Landed) -> str | None:
    """The sha256 of the object ``key`` recorded as ``shard``: the store's checksum when
    it keeps one; the recorded one when the object's ETag is the one recorded (the very
    object stored then: a changed object has another ETag, and reading back a large
    output to hash it would cost what resuming saves); else its bytes hashed as they are
    read. None when it is missing or of another size."""
    size = shard.file.size
    info = storage.head(key)
    if info is None or info.size != size:
        return None
    if info.sha256 is not None:
        return info.sha256
    if shard.etag is not None and info.etag == shard.etag:
        return shard.file.sha256
    digest = hashlib.sha256()
    got = 0
    if size:
        for chunk in storage.iter_range(key, 0, size - 1, if_match=info.etag):
            digest.update(chunk)
            got += len(chunk)
    return digest.hexdigest() if got == size else None


def verified(storage: Storage, prefix: str, files: Mapping[str, Landed]
             ) -> dict[str, Landed]:
    """Those of ``files`` stored under ``prefix`` with their recorded size and sha256."""
    good: dict[str, Landed] = {}
    for name, f in sorted(files.items()):
        try:
            sha = stored_sha256(storage, f"{prefix}/{name}", f)
        except StorageError as exc:
            log.warning("shard %s/%s not verified (made again): %s", prefix, name, exc)
            continue
        if sha == f.file.sha256:
            good[name] = f
        else:
            log.warning("shard %s/%s does not match its record: made again", prefix, name)
    return good


@dataclass(frozen=True)
class Resumed:
    """What an attempt starts from: the prefix it publishes under, the shards already
    there, and (when it took an earlier attempt's prefix over) what it says about it."""

    prefix: str
    landed: dict[str, Landed]
    note: dict[str, Any] | None = None

    @property
    def done(self) -> dict[str, WrittenFile]:
        """The shards the merge need not make (``EngineOptions.done_shards``)."""
        return {n: s.file for n, s in self.landed.items()}


def adopt(rec: JobRecord, storage: Storage, prefix: str) -> Resumed:
    """Where the attempt whose own prefix is ``prefix`` starts: from the record's
    published shards when an earlier attempt left some (their prefix, those verified),
    else from nothing under its own prefix."""
    found = recorded(rec)
    # Only an attempt prefix of this very job is taken over (never a path elsewhere).
    if found is None or not re.fullmatch(rf"jobs/{re.escape(rec.id)}/a\d+", found[0]):
        return Resumed(prefix, {})
    earlier, files = found
    done = verified(storage, earlier, files)
    total = _planned_count(files)
    log.info("job %s: resuming under %s: %d of %d recorded shards verified", rec.id,
             earlier, len(done), len(files))
    # Said in the job's progress only when something was kept (the prefix is taken over
    # either way: whatever lies there is made again over it).
    return Resumed(earlier, done, {"shards": len(done), "of": total} if done else None)


def _planned_count(files: Mapping[str, Landed]) -> int | None:
    """The output's shard count, read from a recorded shard's name (``-of-N``)."""
    for name in files:
        stem = name.removesuffix(".safetensors")
        if "-of-" in stem:
            try:
                return int(stem.rsplit("-of-", 1)[1])
            except ValueError:
                return None
    return 1 if files else None


class ShardLedger:
    """The attempt's published shards, written to the job's record as each lands.

    ``write`` is the attempt's checked record write (``worker.runner.Attempt.write``):
    it raises when the job is no longer this attempt's, so a shard is only recorded
    while the attempt owns the job. Snapshots are taken and written under one lock, so
    the record only ever grows."""

    def __init__(self, job_id: str, attempt: int, write: Callable[[dict[str, Any]], None],
                 start: Resumed, storage: Storage) -> None:
        self.job_id = job_id
        self.attempt = attempt
        self._write = write
        self.storage = storage
        self.prefix = start.prefix
        self._files = dict(start.landed)
        self._lock = threading.Lock()

    def _doc(self) -> dict[str, Any]:
        return {"prefix": self.prefix,
                "files": {n: {"size": s.file.size, "sha256": s.file.sha256, "etag": s.etag}
                          for n, s in sorted(self._files.items())}}

    def begin(self) -> None:
        """Record the prefix and the verified shards (dropping any that failed)."""
        with self._lock:
            self._write({FIELD: self._doc()})

    def landed(self, name: str, size: int, sha256: str) -> None:
        """Shard ``name`` is stored and verified under the prefix."""
        try:
            info = self.storage.head(f"{self.prefix}/{name}")
        except StorageError:  # recorded without: a resumed attempt then reads it back
            info = None
        # An ETag is only trusted later for an object of the size verified now.
        etag = info.etag if info is not None and info.size == size and info.etag else None
        with self._lock:
            self._files[name] = Landed(WrittenFile(name, size, sha256), etag)
            self._write({FIELD: self._doc()})
        log.info("job %s attempt %d: shard %s stored and recorded", self.job_id,
                 self.attempt, name)
