"""One job attempt: claim -> fetch inputs -> produce (the job's kind) -> reserve ->
publish -> mark done.

Celery-free (the task in ``worker.tasks`` only calls :func:`run_job`), so tests can drive
it directly. Every record write goes through the attempt number the claim returned:
a worker whose lease was taken over stops at its next write instead of clobbering the
new owner's state.
"""

from __future__ import annotations

import logging
import shutil
import socket
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded

from app.artifacts import StorageArtifactStore, artifact_scope
from app.disk_cache import Hold
from app.jobs.accounting import finish_increments
from app.jobs.calls import Claim, QuotaExceeded
from app.jobs.record import JobRecord, now_iso
from app.jobs.worker_store import WorkerJobStore
from app.settings import Settings
from app.sources import Source, check_not_service_storage, is_pinned_gguf
from app.storage.base import Storage, StorageError
from maec_contract import FileInfo, JobResult
from maec_core.service import (
    MANIFEST_NAME,
    Cancelled,
    FileEntry,
    MaecError,
    Manifest,
    NotSplittable,
    StageSpans,
)
from maec_core.service.running import EngineOptions, RunContext, WrittenFile
from worker.gguf import dequantize_input
from worker.inputs import InputCache, fetch_source
from worker.job_kind import Made, Planned, Run
from worker.kinds import kind_of
from worker.measure import measured
from worker.partial import (
    PartialInputs,
    fetch_headers,
    fetches_in_part,
    make_shards,
    shards_left,
)
from worker.publish import ShardUploads, publish
from worker.result import Finished
from worker.resume import Resumed, ShardLedger, adopt, in_use
from worker.stages import MergeJob

log = logging.getLogger("maec.worker")


class LeaseLost(Exception):
    """The record no longer belongs to this attempt: stop without writing."""


class TimeLimit(Exception):
    """The job ran out of time (Celery's soft limit raises its own, handled alike)."""


def worker_name() -> str:
    return f"{socket.gethostname()}:{threading.get_native_id()}"


def result_prefix(job_id: str, attempt: int) -> str:
    """Staging prefix of one attempt: a redelivered attempt never writes into another's."""
    return f"jobs/{job_id}/a{attempt}"


@dataclass
class Attempt:
    """The live state of one attempt, shared by progress, cancel and the lease thread."""

    store: WorkerJobStore
    settings: Settings
    job_id: str
    attempt: int
    stage: str = "fetch"
    # The job's stage spans, from its plan (set once the recipe is planned).
    spans: StageSpans = field(default_factory=lambda: StageSpans({}))
    cancelled: bool = False
    lost: bool = False
    _last_write: float = 0.0
    _last_poll: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    # A resumed attempt: the shards it starts with, and the least fraction it reports
    # (the resumed part's; worker.resume).
    resume: Resumed | None = None
    floor: float = 0.0
    # The inputs as held in part, when this attempt fetches only what it reads
    # (worker.partial); None: whole files.
    inputs: PartialInputs | None = None

    def write(self, fields: dict[str, Any]) -> None:
        with self._lock:
            flag = self.store.update(self.job_id, self.attempt, fields)
            self._last_write = self._last_poll = time.monotonic()
        if flag < 0:
            self.lost = True
            raise LeaseLost(self.job_id)
        self.cancelled = self.cancelled or flag == 1

    def progress(self, stage: str, done: int, total: int) -> None:
        stage, fraction = self.spans.at(stage, done, total)
        self.report(stage, fraction, done, total)

    def report(self, stage: str, fraction: float, done: int, total: int,
               **extra: Any) -> None:
        """Write progress: ``fraction`` of the whole job, ``done``/``total`` of the stage
        (``extra``: more progress fields, e.g. a sweep's candidate)."""
        fraction = max(fraction, self.floor)
        if self.resume is not None and self.resume.note is not None:
            extra = {**extra, "resumed": self.resume.note}
        changed = stage != self.stage
        self.stage = stage
        # Throttled: one Redis write per interval, but always on a stage change and at
        # the end of a stage, so a poller sees every stage and its completion.
        if changed or done >= total or (
            time.monotonic() - self._last_write >= self.settings.progress_interval
        ):
            self.write({"stage": stage, "progress": {
                "fraction": round(fraction, 4), "done": done, "total": total, **extra}})

    def cancel_requested(self) -> bool:
        """The engine's cancel callback: the record's flag, read at most every interval."""
        if self.lost:
            raise LeaseLost(self.job_id)
        if not self.cancelled and (
            time.monotonic() - self._last_poll >= self.settings.cancel_poll_interval
        ):
            self._last_poll = time.monotonic()
            self.cancelled = self.store.cancel_requested(self.job_id)
        return self.cancelled

    def start_lease(self) -> threading.Thread:
        """Renew the lease from a thread, so a long tensor op cannot let it lapse."""
        period = max(0.5, self.settings.lease_seconds / 3)

        def renew() -> None:
            while not self._stop.wait(period):
                try:
                    self.write({"lease_until": time.time() + self.settings.lease_seconds})
                except LeaseLost:
                    log.warning("job %s: lease lost to another attempt", self.job_id)
                    return
                except Exception as exc:  # Redis blip: the next renewal retries
                    log.warning("job %s: lease renewal failed: %s", self.job_id, exc)

        t = threading.Thread(target=renew, name="maec-lease", daemon=True)
        t.start()
        return t

    def stop_lease(self) -> None:
        self._stop.set()


@dataclass
class Outcome:
    status: str
    error: dict[str, Any] | None = None


# Claim outcomes in which the claim itself ended the job.
ENDED_BY_CLAIM = frozenset({"cancelled", "exhausted", "time_limit"})


# A split merge's parts all done: the prefix their shards lie under, those shards, and
# the records its phases decided (EngineOptions.phase_records; none: split by shards).
SplitDone = tuple[str, dict[str, WrittenFile], tuple[str, ...]]
# worker.split.coordinate: (runner, record, attempt, planned job, inputs, prefix, workdir).
SplitFn = Callable[["JobRunner", JobRecord, Attempt, Planned, dict[str, str], str, Path],
                   SplitDone | None]


class JobRunner:
    def __init__(self, settings: Settings, store: WorkerJobStore, storage: Storage,
                 *, worker: str | None = None,
                 on_finished: Callable[[str], None] | None = None,
                 send_part: Callable[[str], None] | None = None,
                 split: SplitFn | None = None) -> None:
        self.settings = settings
        self.store = store
        self.storage = storage
        self.worker = worker or worker_name()
        # Called with the id of a job this runner ended that names a callback_url (the
        # worker queues its webhook); after the terminal write, never before.
        self.on_finished = on_finished
        # Asks the pool for a helper on a split job's parts (worker.split); None: this
        # runner runs every part itself.
        self.send_part = send_part
        # Runs a big merge as parts first (worker.split.coordinate); None: never split.
        self.split = split
        self.cache = InputCache(settings.work_dir / "cache", settings.cache_max_bytes)

    def run(self, job_id: str) -> str:
        """Run ``job_id`` if it is claimable; returns the claim or final outcome."""
        claim = self.store.claim(job_id, worker=self.worker,
                                 lease_s=self.settings.lease_seconds,
                                 max_attempts=self.settings.max_attempts,
                                 time_limit_s=self.settings.task_time_limit,
                                 pool=self.settings.own_pool)
        return self.run_claimed(job_id, claim)

    def run_claimed(self, job_id: str, claim: Claim) -> str:
        """Go on from ``claim`` (this runner's, or the scheduler's take, which claims in
        the same call that chooses the job: worker.dispatch)."""
        if claim.outcome != "claimed":
            log.info("job %s: not run (%s)", job_id, claim.outcome)
            if claim.outcome in ENDED_BY_CLAIM:
                # A dead attempt may have uploaded shards during its merge (never a
                # manifest: that is written last); the job ended without a result.
                self._cleanup(f"jobs/{job_id}")
                ended = self.store.get(job_id)
                self._finished(job_id, ended.callback_url if ended else None)
            return claim.outcome
        rec = self.store.get(job_id)
        assert rec is not None
        started = time.monotonic()
        att = Attempt(self.store, self.settings, job_id, claim.attempt)
        prefix = result_prefix(job_id, claim.attempt)
        workdir = self.settings.work_dir / "jobs" / job_id / f"a{claim.attempt}"
        att.start_lease()
        log.info("job %s: attempt %d on %s", job_id, claim.attempt, self.worker)
        try:
            # --- resume: an earlier attempt's published shards (worker.resume) ---
            att.resume = adopt(rec, self.storage, prefix)
            prefix = att.resume.prefix
            # --- end resume ---
            for earlier in range(1, claim.attempt):
                # A dead attempt's partial upload: nobody will ever read it (but the
                # shards this attempt resumes from).
                if result_prefix(job_id, earlier) != prefix:
                    self.storage.delete_prefix(result_prefix(job_id, earlier) + "/")
            outcome = self._attempt(rec, att, prefix, workdir, started)
        except LeaseLost:
            log.warning("job %s attempt %d: stopped, the job was taken over",
                        job_id, claim.attempt)
            # This attempt's prefix: shards it uploaded during the merge (the new owner
            # writes under its own and removes this one when it starts), unless the
            # record names it: the new owner resumes from it.
            if not self._resumed_from(job_id, prefix):
                self._cleanup(prefix)
            return "lost"
        finally:
            att.stop_lease()
            shutil.rmtree(workdir, ignore_errors=True)
        return outcome

    def _attempt(self, rec: JobRecord, att: Attempt, prefix: str, workdir: Path,
                 started: float) -> str:
        try:
            # The job's cache entries stay held (never evicted) until it ends.
            with self.cache.hold() as hold:
                result = self.execute(rec, att, prefix, workdir, hold)
        except (Cancelled, _CancelledHere):
            self._cleanup(prefix)
            return self._end(rec, att, "cancelled", None, started)
        except (TimeLimit, SoftTimeLimitExceeded):
            self._cleanup(prefix)
            return self._end(rec, att, "failed", {
                "code": "time_limit",
                "message": f"the job ran past its {self.settings.task_time_limit} s limit",
                "details": {"limit_s": self.settings.task_time_limit}}, started)
        except LeaseLost:
            raise
        except MaecError as exc:
            self._cleanup(prefix)
            log.warning("job %s failed: %s", rec.id, exc)
            return self._end(rec, att, "failed", exc.to_dict(), started)
        except Exception as exc:
            self._cleanup(prefix)
            log.exception("job %s: unexpected error", rec.id)
            # Running out of memory is the job's size, not a bug: say so.
            oom = isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
            return self._end(rec, att, "failed", {
                "code": "out_of_memory" if oom else "internal_error",
                "message": f"{type(exc).__name__}: {exc}", "details": {}}, started)
        return self._end(rec, att, "succeeded", None, started, result=result)

    def _cleanup(self, prefix: str) -> None:
        try:
            self.storage.delete_prefix(prefix + "/")
        except StorageError as exc:
            log.warning("could not clean staging %s: %s", prefix, exc)
            # The store is down: the workers' heartbeat deletes it once it is back.
            self.store.remember_orphan(prefix + "/")

    def _resumed_from(self, job_id: str, prefix: str) -> bool:
        try:
            return in_use(self.store, job_id, prefix)
        except Exception as exc:  # Redis down: left in place, removed with the job
            log.warning("job %s: could not tell whether %s is resumed from: %s", job_id,
                        prefix, exc)
            return True

    def _end(self, rec: JobRecord, att: Attempt, status: str, error: dict[str, Any] | None,
             started: float, result: Finished | None = None) -> str:
        seconds = time.monotonic() - started
        fields: dict[str, Any] = {"finished_at": now_iso(), "stage": None, "error": error,
                                  "measured": measured(seconds)}
        if status != "succeeded":
            self._release(rec, att)
        nbytes = 0
        if result is not None:
            nbytes = result.nbytes
            fields.update(result.fields())
            if att.resume is not None and att.resume.note is not None:
                # The finished job (and its webhook) still says it was resumed.
                fields["progress"] = {**fields["progress"], "resumed": att.resume.note}
        ok, previous = self.store.transition(
            rec.id, allowed=("running", "publishing"), to=status, attempt=att.attempt,
            fields=fields, metrics=finish_increments(status, seconds, nbytes),
        )
        self._forget_parts(rec.id)
        if not ok:
            log.warning("job %s: could not mark %s (record says %s)", rec.id, status,
                        previous)
            return "lost"
        log.info("job %s: %s in %.2f s", rec.id, status, seconds)
        self._finished(rec.id, rec.callback_url)
        return status

    def _forget_parts(self, job_id: str) -> None:
        """A split job's parts, once it ended (they expire anyway)."""
        try:
            self.store.parts().remove(job_id)
        except Exception as exc:
            log.warning("job %s: parts not removed: %s", job_id, exc)

    def _finished(self, job_id: str, callback_url: str | None) -> None:
        """Hand an ended job to ``on_finished`` if it asked for a webhook. Never raises:
        a webhook that cannot be queued must not turn a finished merge into an error."""
        if self.on_finished is None or callback_url is None:
            return
        try:
            self.on_finished(job_id)
        except Exception as exc:
            log.error("job %s: webhook not queued: %s", job_id, exc)

    def _release(self, rec: JobRecord, att: Attempt) -> None:
        """Give back this attempt's quota reservation and artifact references."""
        try:
            self.store.release(rec, att.attempt)
        except Exception as exc:  # Redis down: deleting the job gives them back later
            log.warning("job %s: reservation not released: %s", rec.id, exc)

    def _reserve(self, rec: JobRecord, att: Attempt, manifest: Manifest, entry: FileEntry,
                 already: int = 0) -> None:
        """Count the outputs (the manifest's ``entry`` too, and ``already`` uploaded
        bytes: a sweep's candidates) against the owner's storage quota before uploading
        them."""
        nbytes = already + manifest.nbytes + entry.size
        self._reserve_bytes(rec, att, nbytes, manifest.artifact_keys)

    def _reserve_bytes(self, rec: JobRecord, att: Attempt, nbytes: int,
                       keys: tuple[str, ...] = ()) -> None:
        quota = self.settings.storage_quota_bytes_per_key
        outcome, used = self.store.reserve(rec, att.attempt, nbytes, quota=quota,
                                           artifacts=keys)
        if outcome == "lost":
            raise LeaseLost(rec.id)
        if outcome == "over":
            raise QuotaExceeded(
                f"the outputs ({nbytes} bytes) would take key {rec.owner} past its storage "
                f"quota ({used} of {quota} bytes in use); delete jobs to free space",
                bytes=nbytes, used=used, quota=quota)

    def _fetch(self, rec: JobRecord, job: Planned, att: Attempt, workdir: Path,
               hold: Hold) -> dict[str, str]:
        """Every source into the job's input folder, as pinned at submission (a changed
        one fails the job with ``source_changed``); returns ``{uri: local path}``."""
        local: dict[str, str] = {}
        total = len(rec.sources)
        att.progress("fetch", 0, total)
        fetched = cached = 0
        for i, (uri, doc) in enumerate(sorted(rec.sources.items())):
            if att.cancel_requested():
                raise _CancelledHere
            # Checked again here: a record queued before the rule existed (or written by
            # anything but the API) must not read the service's own storage either.
            source = check_not_service_storage(Source.from_dict(doc), self.settings)
            gguf = is_pinned_gguf(source)
            path, got, hit = fetch_source(source, self.storage, self.cache,
                                          workdir / "inputs" / str(i),
                                          corpus=gguf or job.one_file(uri), hold=hold)
            if gguf:  # merged from its dequantized folder (worker/gguf.py)
                path = dequantize_input(path, self.cache, hold,
                                        self.settings.work_dir / "checksums")
            local[uri] = str(path)
            fetched, cached = fetched + got, cached + hit
            att.progress("fetch", i + 1, total)
        log.info("job %s: inputs ready (%d bytes fetched, %d from cache)", rec.id,
                 fetched, cached)
        return local

    def fetch_inputs(self, rec: JobRecord, job: Planned, att: Attempt, workdir: Path,
                     hold: Hold, *, resuming: bool = False, part: bool = False
                     ) -> dict[str, str]:
        """The job's inputs: whole files, or only their headers when the attempt
        fetches in part (``worker.partial``: a job that may be split, a ``part`` of
        one, or one ``resuming``), its ranges fetched later (``att.inputs``)."""
        sources = fetches_in_part(rec, job, self.settings, self.storage,
                                  split=self.split is not None, resuming=resuming or part)
        if sources is None:
            return self._fetch(rec, job, att, workdir, hold)
        att.progress("fetch", 0, 1)
        att.inputs = fetch_headers(sources, self.cache, workdir, hold)
        if not part:  # this attempt publishes the manifest, which names them
            att.inputs.start_digests()
        att.progress("fetch", 1, 1)
        log.info("job %s: input headers ready (%d bytes fetched, %d from cache)", rec.id,
                 att.inputs.fetched, att.inputs.cached)
        return att.inputs.local

    def _make_left(self, rec: JobRecord, job: Planned, att: Attempt, local: dict[str, str],
                   done: Mapping[str, WrittenFile], uploads: ShardUploads,
                   workdir: Path) -> dict[str, WrittenFile]:
        """An attempt holding its inputs in part that runs the merge itself (a resumed
        one): the shards not ``done`` made and uploaded (``uploads``), their inputs'
        byte ranges fetched as the merge goes (``worker.partial.make_shards``); all the
        shards then done. A merge whose reads are not named by shard fetches its weight
        files whole and leaves its shards to the merge."""
        inputs = att.inputs
        if inputs is None or not isinstance(job, MergeJob):
            return dict(done)
        recipe = job.plan.localised(local).merge_only()
        try:
            left = shards_left(recipe, done)
            ctx = RunContext(progress=att.progress, cancel=att.cancel_requested,
                             device=self.settings.device,
                             hash_cache=self.settings.work_dir / "checksums",
                             options=EngineOptions(on_shard=uploads.on_shard,
                                                   on_shard_open=uploads.on_shard_open))
            made = make_shards(recipe, left, inputs, workdir / "parts", ctx, done)
        except NotSplittable:
            inputs.complete()
            made = {}
        log.info("job %s: inputs ready (%d bytes fetched, %d from cache; in part: %d "
                 "shards were done)", rec.id, inputs.fetched, inputs.cached, len(done))
        return {**done, **made}

    def _split(self, rec: JobRecord, att: Attempt, job: Planned, local: dict[str, str],
               prefix: str, workdir: Path) -> SplitDone | None:
        split = None if self.split is None else self.split(self, rec, att, job, local,
                                                            prefix, workdir)
        if split is not None:
            att.floor = max(att.floor, job.spans.at("merge", 1, 1)[1])
        return split

    def execute(self, rec: JobRecord, att: Attempt, prefix: str, workdir: Path,
                hold: Hold) -> Finished:
        """The attempt's one path, for every kind of job: plan, fetch, produce (the
        kind's step), then reserve and publish (:meth:`_publish_made`)."""
        job = kind_of(rec).plan(rec)
        att.spans = job.spans
        # A resumable job records each shard in the job's record as it lands, and skips
        # those it resumes with (its progress starts there: before the fetch).
        ledger = self._ledger(att, job, prefix)
        done = att.resume.done if ledger is not None and att.resume is not None else {}
        local = self.fetch_inputs(rec, job, att, workdir, hold, resuming=bool(done))
        job.check(local)
        # --- split: a big merge's parts run on the pool's workers first (worker.split);
        # this attempt then goes on as a resumed merge with every shard done ---
        split = self._split(rec, att, job, local, prefix, workdir)
        records: tuple[str, ...] = ()
        if split is not None:
            ledger, (prefix, done, records) = None, split
        # --- end split ---
        workdir.mkdir(parents=True, exist_ok=True)
        out = workdir / "out"
        uploaded = [0]

        def upload(key: str, path: Path) -> None:
            # A file beside the output (a sweep's candidate), counted against the quota
            # first.
            if att.cancel_requested():
                raise _CancelledHere
            uploaded[0] += path.stat().st_size
            self._reserve_bytes(rec, att, uploaded[0])
            self.storage.put_file(f"{prefix}/{key}", path)

        # The output's shards go up while the merge goes on; stopped before any clean-up
        # of the prefix (the caller's), so nothing lands after it.
        uploads = ShardUploads(self.storage, prefix,
                               on_stored=ledger.landed if ledger is not None else None)
        try:
            if split is None and att.inputs is not None:
                done = self._make_left(rec, job, att, local, done, uploads, workdir)
            made = job.produce(Run(local, out, workdir,
                                   self._context(rec, att, uploads, hold, done, records),
                                   att, upload,
                                   att.inputs.digests() if att.inputs is not None else {}))
            files = [*made.uploaded,
                     *self._publish_made(rec, att, out, made, uploads, uploaded[0], done)]
        except BaseException:
            uploads.stop()
            raise
        uploads.close()
        result = JobResult(
            manifest=dict(made.manifest.doc), report=made.report,
            files=[FileInfo(**f.to_json()) for f in files],
            core_seconds=round(made.core_seconds, 4), **made.result)
        return Finished(result, prefix, made.artifact_reused)

    def artifacts(self, hold: Hold | None) -> StorageArtifactStore:
        """The worker's artifact store; the local artifact copies a job reads stay held
        by ``hold``, like its inputs, until it ends."""
        return StorageArtifactStore(self.storage, self.settings.work_dir / "artifacts",
                                    self.settings.artifact_cache_max_bytes,
                                    on_use=self.store.touch_artifact, hold=hold)

    def _context(self, rec: JobRecord, att: Attempt, uploads: ShardUploads, hold: Hold,
                 done: Mapping[str, WrittenFile], records: tuple[str, ...] = ()
                 ) -> RunContext:
        """How the attempt's core run goes: the attempt's progress and cancel, the
        worker's device and caches, the output's shards uploaded as they are written
        (``done``: those already published, which the engine skips; ``records``: what
        a split merge's phases decided)."""
        return RunContext(progress=att.progress, cancel=att.cancel_requested,
                          device=self.settings.device,
                          hash_cache=self.settings.work_dir / "checksums",
                          artifact_store=self.artifacts(hold),
                          artifact_scope=artifact_scope(rec.owner),
                          # The run's manifests stay in memory: the one published is
                          # written once, last, with the inputs named by reference.
                          manifest_file=False,
                          options=EngineOptions(on_shard=uploads.on_shard,
                                                on_shard_open=uploads.on_shard_open,
                                                done_shards=done or None,
                                                phase_records=records,
                                                present=att.inputs.present
                                                if att.inputs is not None else None))

    def _ledger(self, att: Attempt, job: Planned, prefix: str) -> ShardLedger | None:
        """The resumable job's shard record, begun (the verified shards it resumes
        with written first); its progress floor set. None: not resumable."""
        if not job.resumable:
            return None
        start = att.resume if att.resume is not None else Resumed(prefix, {})
        ledger = ShardLedger(att.job_id, att.attempt, att.write, start, self.storage)
        ledger.begin()
        of = (start.note or {}).get("of")
        if start.done and of:
            att.floor = job.spans.at("combine", len(start.done), int(of))[1]
        return ledger

    def _publish_made(self, rec: JobRecord, att: Attempt, out: Path, made: Made,
                      uploads: ShardUploads, already: int,
                      stored: Collection[str] = ()) -> list[FileEntry]:
        """The publish tail of every kind: the manifest written (once, its entry taken
        from the bytes written), the outputs counted against the quota (``already``:
        bytes uploaded beside them), then every file not uploaded yet and manifest.json
        last; the published files' entries."""
        entry = made.manifest.write(out)
        # Before the manifest can publish anything: a job over its owner's quota fails
        # here, and the shards it uploaded meanwhile go with its prefix.
        self._reserve(rec, att, made.manifest, entry, already)
        return self._publish(rec, att, out, made.manifest, entry, uploads, stored)

    def _publish(self, rec: JobRecord, att: Attempt, out: Path, manifest: Manifest,
                 entry: FileEntry, uploads: ShardUploads,
                 stored: Collection[str] = ()) -> list[FileEntry]:
        """Every file not uploaded yet, then manifest.json last (the commit marker, its
        file ``entry``), once every other file is stored and verified; the files'
        entries."""
        ok, _ = self.store.transition(rec.id, allowed=("running",), to="publishing",
                                      attempt=att.attempt)
        if not ok:
            raise LeaseLost(rec.id)
        files = list(manifest.files)
        att.progress("publish", 0, len(files) + 1)
        if not publish(uploads, out, files, out / MANIFEST_NAME, stored=stored,
                       cancelled=att.cancel_requested,
                       progress=lambda n, total: att.progress("publish", n, total)):
            raise _CancelledHere
        files.append(entry)
        att.progress("publish", len(files), len(files))
        return files


class _CancelledHere(Exception):
    """Cancel noticed by the runner itself (fetch or publish), outside the engine."""
