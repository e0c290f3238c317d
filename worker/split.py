"""One big merge split across a pool's workers: parts by shard groups, then a final step.

A plain merge (a tensor method's, or one its method splits in phases; not a sweep, an
evaluation or an MoE) whose inputs total more than the pool's ``split_above_bytes`` runs
as parts: its fixed output shard plan (``planned_shard_count``) is cut into
``split_parts`` contiguous groups (:func:`app.jobs.parts.part_ranges`), kept in the job
store (:mod:`app.jobs.parts`).

- The job's own attempt, claimed as any job's (fair share, cancel, drain, pin and
  leases as for a whole job), is the coordinator (:func:`coordinate`): it creates the
  parts, asks the pool for ``parts - 1`` helpers (``maec.run_part`` tasks, each running
  :func:`help_parts`), and runs parts itself until none is left to claim; meanwhile it
  writes the job's progress as the fraction done over all parts.
- Each part is claimed with its own attempt and lease. It publishes its shards under
  the job's prefix as they are made (``EngineOptions.part``) and records each in its
  entry as it lands; a part whose worker is lost is claimed again once its lease runs
  out (by a helper or the coordinator) and, like a resumed job, verifies and skips the
  shards already recorded (``EngineOptions.done_shards``).
- A merge whose method decides something over the whole model (``phased``: which
  tensors to change, say, from a statistic of every tensor) runs in phases. The
  coordinator runs the method's step before the parts once (what every part then
  reads: found in a store, or made there) and keeps its record beside the parts; every
  part then runs each earlier phase (a statistic of its shards' tensors) and keeps its
  small result in its entry; once all are done, the coordinator alone decides from the
  results, records the decision and begins the next phase (asking the pool for helpers
  again). A phase is begun once, by whoever records its decision first; the last phase
  makes the shards with every record given (``EngineOptions.phase_records``). The
  method says what each step does (``PhasedMerge``); nothing here knows which method.
- Once every part is done, the coordinator's attempt goes on as a resumed merge with
  every shard done (and the records): the engine reads and computes nothing, writes
  the index, the model card and the other files, and the manifest is published last,
  fenced by the job's attempt, so it is written once. The result is the unsplit
  merge's byte for byte.

A part fetches of the inputs only what its shards read (worker/partial.py): each weight
file's header, then the byte ranges of the input tensors its shards read (the engine's
own shard plan names them), group by group while the merge runs, into partial entries
of the worker's cache; the engine refuses to read any byte not fetched. The final step
reads no tensor: its manifest names the inputs' digests the store gives. Where a digest
is not known without a whole copy (an S3 object without a whole-object SHA-256), or the
merge's reads are not named by shard, the inputs are fetched whole, as before.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.artifacts import artifact_scope
from app.disk_cache import Hold
from app.jobs.parts import Part, Parts, PartStore, part_ranges
from app.jobs.record import JobRecord
from app.storage.base import StorageError
from maec_core.service import Cancelled, MaecError, parse_recipe, plan_job
from maec_core.service.running import (
    EngineOptions,
    PhasedMerge,
    RunContext,
    WrittenFile,
    phased,
    planned_shard_count,
    run,
)
from worker.drain import draining
from worker.job_kind import Planned
from worker.partial import PartialInputs, make_shards, shard_index
from worker.publish import ShardUploads
from worker.resume import FIELD, Landed, Resumed, ShardLedger, verified
from worker.runner import Attempt, JobRunner, LeaseLost, SplitDone
from worker.stages import MergeJob

log = logging.getLogger("maec.worker")

# How often a coordinator with no part left to claim looks at the others (seconds).
POLL_S = 0.2
# How long a part whose upload the store refused waits before it is claimed again.
RETRY_PAUSE_S = 1.0


class PartFailed(MaecError):
    """A part of a split merge failed (its error is the one given), or ran out of
    attempts."""

    code = "part_failed"


def input_bytes(local: dict[str, str]) -> int:
    """The fetched inputs' size: what ``split_above_bytes`` is compared with."""
    total = 0
    for path in set(local.values()):
        p = Path(path)
        files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
        total += sum(f.stat().st_size for f in files)
    return total


def shard_count(runner: JobRunner, job: Planned, local: dict[str, str]) -> int | None:
    """The output's shard count when this merge is to be split, else None."""
    if (runner.settings.split_above_bytes <= 0 or not isinstance(job, MergeJob)
            or not job.resumable):
        return None
    if input_bytes(local) <= runner.settings.split_above_bytes:
        return None
    n = planned_shard_count(job.plan.localised(local).merge_only())
    return n if n is not None and n >= 2 else None


def coordinate(runner: JobRunner, rec: JobRecord, att: Attempt, job: Planned,
               local: dict[str, str], prefix: str, workdir: Path) -> SplitDone | None:
    """Run ``rec``'s merge as parts when it is to be split (None: run it whole); the
    prefix the parts' shards lie under, those shards (the final step's done ones) and
    the records of its phases (none for a merge split by shards alone)."""
    n = shard_count(runner, job, local)
    if n is None or not isinstance(job, MergeJob):
        return None
    store = runner.store.parts()
    phases = phased(job.plan.localised(local).merge_only())
    if store.get(rec.id) is None:
        # A later coordinator attempt goes on with the parts (and the record) it finds.
        before = "" if phases is None else phases.before(
            workdir / "before", _context(runner, rec, att, None))
        store.create(rec.id, prefix, part_ranges(n, runner.settings.split_parts),
                     phases=1 + (len(phases.phases) if phases is not None else 0),
                     before=before)
    state = store.get(rec.id)
    assert state is not None
    log.info("job %s: split into %d parts of %d shards under %s", rec.id,
             len(state.parts), n, state.prefix)
    _ask_helpers(runner, rec.id, state)
    stop = threading.Event()
    reporter = threading.Thread(target=_report, args=(store, rec.id, att, stop),
                                name="maec-split-progress", daemon=True)
    reporter.start()
    try:
        _drive(runner, rec, att, job, local, store, workdir, phases)
    except (Cancelled, PartFailed):
        _wait_stopped(store, rec.id, runner.settings.lease_seconds)
        raise
    finally:
        stop.set()
        reporter.join()
    final = store.get(rec.id)
    assert final is not None
    return final.prefix, {name: WrittenFile(name, int(s["size"]), str(s["sha256"]))
                          for p in final.parts for name, s in p.shards.items()}, _records(final)


def _records(state: Parts) -> tuple[str, ...]:
    """What the last phase is given: every record, when the merge runs in phases."""
    return tuple(state.records) if state.phases > 1 else ()


def _ask_helpers(runner: JobRunner, job_id: str, state: Parts) -> None:
    if runner.send_part is not None:
        for _ in range(len(state.parts) - 1):
            runner.send_part(job_id)


def _context(runner: JobRunner, rec: JobRecord, att: Attempt, hold: Hold | None,
             options: EngineOptions | None = None) -> RunContext:
    """How a part (or the step before the parts) runs: the attempt's progress and
    cancel, the worker's device, digest cache and artifact store (the job owner's
    scope, as for the job run whole)."""
    return RunContext(progress=att.progress, cancel=att.cancel_requested,
                      device=runner.settings.device,
                      hash_cache=runner.settings.work_dir / "checksums",
                      artifact_store=runner.artifacts(hold),
                      artifact_scope=artifact_scope(rec.owner),
                      options=options or EngineOptions())


def _drive(runner: JobRunner, rec: JobRecord, att: Attempt, job: MergeJob,
           local: dict[str, str], store: PartStore, workdir: Path,
           phases: PhasedMerge | None) -> None:
    """Claim and run parts until every part is done (the helpers run the others),
    deciding between phases."""
    while True:
        if att.cancel_requested():
            raise Cancelled("the job was cancelled")
        index, attempt = _claim(runner, store, rec.id)
        if index >= 0:
            try:
                run_claimed_part(runner, rec, job, index, attempt, local,
                                 workdir / f"p{index}", inputs=att.inputs)
            except LeaseLost:
                if att.lost:  # the job itself was taken over
                    raise
                log.warning("job %s: part %d taken over", rec.id, index)
            except StorageError as exc:
                _release(store, rec.id, index, attempt, exc)
            continue
        state = store.get(rec.id)
        if state is None:
            raise PartFailed("the split merge's parts are gone from the job store")
        failed = [p for p in state.parts if p.state == "failed"] if index == -1 else [
            state.parts[attempt]]
        if failed:
            raise PartFailed(f"part {failed[0].index} of the split merge failed: "
                             f"{_error(failed[0])}")
        if state.done:
            return
        if state.phase_done:
            assert phases is not None
            _advance(runner, rec, att, store, state, phases)
            continue
        time.sleep(POLL_S)


def _advance(runner: JobRunner, rec: JobRecord, att: Attempt, store: PartStore,
             state: Parts, phases: PhasedMerge) -> None:
    """Every part done with a phase before the last: decide from their results, once,
    and begin the next phase."""
    record = phases.decide(state.phase, [p.result or "" for p in state.parts],
                           state.records, _context(runner, rec, att, None))
    if store.advance(rec.id, state.phase, record) == 1:
        log.info("job %s: phase %s decided, parts begin the next", rec.id,
                 phases.phases[state.phase])
        ahead = store.get(rec.id)
        if ahead is not None:
            _ask_helpers(runner, rec.id, ahead)


def _claim(runner: JobRunner, store: PartStore, job_id: str) -> tuple[int, int]:
    s = runner.settings
    return store.claim(job_id, worker=runner.worker, lease_s=s.lease_seconds,
                       now=time.time(), max_attempts=s.max_attempts)


def _release(store: PartStore, job_id: str, index: int, attempt: int,
             exc: StorageError) -> None:
    """The store refused the part's upload: the part is handed back to be claimed again
    (its recorded shards kept), after a pause; ``max_attempts`` bounds the tries."""
    log.warning("job %s: part %d attempt %d: storage failed, part handed back: %s",
                job_id, index, attempt, exc)
    store.update(job_id, index, attempt, {}, state="pending")
    time.sleep(RETRY_PAUSE_S)


def _error(part: Part) -> str:
    if part.error:
        return str(part.error.get("message") or part.error.get("code"))
    return f"it ran out of its attempts ({part.attempt - part.base})"


def _report(store: PartStore, job_id: str, att: Attempt, stop: threading.Event) -> None:
    """The job's progress: the fraction of the parts done (over its phases), over the
    merge stage."""
    period = max(0.2, att.settings.progress_interval)
    while not stop.wait(period):
        try:
            state = store.get(job_id)
            if state is None:
                return
            done = sum(p.state == "done" for p in state.parts)
            stage, fraction = att.spans.at("merge", 0, 1)
            end = att.spans.at("merge", 1, 1)[1]
            parts: dict[str, int] = {"done": done, "of": len(state.parts)}
            if state.phases > 1:  # the parts' count starts again with each phase
                parts.update(phase=state.phase + 1, phases=state.phases)
            att.report(stage, fraction + (end - fraction) * state.fraction, done,
                       len(state.parts), parts=parts)
        except Exception as exc:  # a Redis blip or a lost lease: the next tick says so
            log.debug("job %s: split progress not written: %s", job_id, exc)


def _wait_stopped(store: PartStore, job_id: str, lease_s: float) -> None:
    """After a cancel, until no other worker still runs a part (each stops its uploads
    first), so that the clean-up of the prefix that follows comes after their last
    upload; at most one lease."""
    deadline = time.monotonic() + lease_s
    while time.monotonic() < deadline:
        state = store.get(job_id)
        if state is None or not any(p.state == "running" for p in state.parts):
            return
        time.sleep(POLL_S)


@dataclass
class PartAttempt(Attempt):
    """One part's attempt: its lease, progress and recorded shards go to the part's
    entry, fenced by the part's attempt; cancel is the job's."""

    parts: PartStore | None = None
    index: int = 0

    def write(self, fields: dict[str, Any]) -> None:
        update: dict[str, Any] = {}
        if "lease_until" in fields:
            update["lease_until"] = fields["lease_until"]
        if "progress" in fields:
            # Done only once marked done (after its last upload).
            update["fraction"] = min(0.99, float(fields["progress"]["fraction"]))
        if FIELD in fields:
            update["shards"] = fields[FIELD]["files"]
        assert self.parts is not None
        with self._lock:
            ok = self.parts.update(self.job_id, self.index, self.attempt, update)
            self._last_write = self._last_poll = time.monotonic()
        if not ok:
            self.lost = True
            raise LeaseLost(self.job_id)


def run_claimed_part(runner: JobRunner, rec: JobRecord, job: MergeJob, index: int,
                     attempt: int, local: dict[str, str] | None, workdir: Path,
                     hold: Hold | None = None, inputs: PartialInputs | None = None
                     ) -> tuple[dict[str, str], PartialInputs | None]:
    """Run part ``index`` (claimed as ``attempt``): make its shards, publish each as it
    is made, record it, and mark the part done; returns the inputs (fetched here when
    ``local`` is None) and, when they are held in part, what is held (``inputs``: the
    part fetches the byte ranges its shards read into it)."""
    store = runner.store.parts()
    state = store.get(rec.id)
    if state is None:
        raise PartFailed("the split merge's parts are gone from the job store")
    part = state.parts[index]
    att = PartAttempt(runner.store, runner.settings, rec.id, attempt, spans=job.spans,
                      parts=store, index=index)
    att.start_lease()
    log.info("job %s: part %d (shards %d-%d) attempt %d on %s", rec.id, index, part.lo,
             part.hi - 1, attempt, runner.worker)
    result: str | None = None
    try:
        if local is None:
            assert hold is not None
            local = runner.fetch_inputs(rec, job, att, workdir, hold, part=True)
            inputs = att.inputs
        if state.last_phase:
            _make_part(runner, rec, job, att, state, local, workdir, hold, inputs)
        else:
            result = _phase_part(runner, rec, job, att, state, local, hold)
    except Cancelled:
        # Its uploads are stopped: the coordinator may clean the prefix now.
        store.update(rec.id, index, attempt, {}, state="stopped")
        raise
    finally:
        att.stop_lease()
        shutil.rmtree(workdir / "out", ignore_errors=True)
    if not store.finish(rec.id, index, attempt, result):
        raise LeaseLost(rec.id)
    if state.last_phase:
        log.info("job %s: part %d done", rec.id, index)
    else:
        log.info("job %s: part %d done with its phase %d", rec.id, index, state.phase)
    return local, inputs


def _phase_part(runner: JobRunner, rec: JobRecord, job: MergeJob, att: PartAttempt,
                state: Parts, local: dict[str, str], hold: Hold | None) -> str:
    """A phase before the last of one part (the merge runs in phases): its result."""
    part = state.parts[att.index]
    phases = phased(job.plan.localised(local).merge_only())
    if phases is None:
        raise PartFailed("the split merge has phases its method does not run")
    return phases.run_part(state.phase, (part.lo, part.hi), state.records,
                           _context(runner, rec, att, hold))


def _make_part(runner: JobRunner, rec: JobRecord, job: MergeJob, att: PartAttempt,
               state: Parts, local: dict[str, str], workdir: Path, hold: Hold | None,
               inputs: PartialInputs | None = None) -> None:
    """The last phase of one part: its shards made, each published and recorded as it
    is made."""
    prefix, part = state.prefix, state.parts[att.index]
    landed = {name: Landed(WrittenFile(name, int(s["size"]), str(s["sha256"])),
                           str(s["etag"]) if s.get("etag") else None)
              for name, s in part.shards.items()}
    good = verified(runner.storage, prefix, landed) if landed else {}
    ledger = ShardLedger(att.job_id, att.attempt, att.write, Resumed(prefix, good),
                         runner.storage)
    ledger.begin()
    uploads = ShardUploads(runner.storage, prefix, on_stored=ledger.landed)
    ctx = _context(runner, rec, att, hold, EngineOptions(
        on_shard=uploads.on_shard, on_shard_open=uploads.on_shard_open,
        done_shards={n: s.file for n, s in good.items()} or None, part=(part.lo, part.hi),
        phase_records=_records(state)))
    recipe = job.plan.localised(local).merge_only()
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        if inputs is None:
            run(recipe, workdir / "out", ctx)
        else:
            # Only the byte ranges this part's shards read (those not published already),
            # fetched group by group as the merge goes.
            before = inputs.fetched
            make_shards(recipe, sorted({*range(part.lo, part.hi)}
                                       - {shard_index(n) for n in good}),
                        inputs, workdir / "out", ctx, ctx.options.done_shards or {})
            log.info("job %s: part %d fetched %d bytes of its inputs in part", att.job_id,
                     part.index, inputs.fetched - before)
        if not uploads.wait(att.cancel_requested, lambda _n: None):
            raise Cancelled("the job was cancelled")
    except BaseException:
        uploads.stop()
        raise
    uploads.close()


def help_parts(runner: JobRunner, job_id: str) -> str:
    """A helper's task: run the job's free parts one after another, until none is left
    (or the job ends). Never raises: a part that fails is marked failed with its error,
    and the coordinator fails the job with it."""
    store = runner.store.parts()
    rec = runner.store.get(job_id)
    if rec is None or rec.status != "running" or store.get(job_id) is None:
        return "ended"
    job = MergeJob(plan_job(parse_recipe(rec.recipe)))
    workdir = runner.settings.work_dir / "jobs" / job_id / f"h{time.time_ns()}"
    local: dict[str, str] | None = None
    inputs: PartialInputs | None = None
    ran = 0
    try:
        with runner.cache.hold() as hold:
            while True:
                if draining():  # the parts left go to the other workers
                    return f"ran {ran} parts, draining"
                index, attempt = _claim(runner, store, job_id)
                if index < 0:
                    return f"ran {ran} parts"
                try:
                    local, inputs = run_claimed_part(runner, rec, job, index, attempt,
                                                     local, workdir / f"p{index}", hold,
                                                     inputs)
                    ran += 1
                except LeaseLost:
                    log.warning("job %s: part %d taken over", job_id, index)
                except StorageError as exc:
                    _release(store, job_id, index, attempt, exc)
                except Cancelled:
                    return "cancelled"
                except Exception as exc:
                    if runner.store.cancel_requested(job_id):  # stopped in its fetch
                        store.update(job_id, index, attempt, {}, state="stopped")
                        return "cancelled"
                    log.warning("job %s: part %d failed: %s", job_id, index, exc)
                    error = exc.to_dict() if isinstance(exc, MaecError) else {
                        "code": "internal_error", "message": f"{type(exc).__name__}: {exc}"}
                    store.update(job_id, index, attempt, {"error": error}, state="failed")
                    return "failed"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
