"""A MAEC merge above the pool's split size runs split into parts, in phases: its
ability vectors found (or extracted once, by the coordinator), c_t measured in parts,
the selection made once from all of them, then combined in parts. Its files and report
are the unsplit merge's; a part or coordinator lost between phases is redone from the
job store, and no phase runs twice to completion."""

from __future__ import annotations

import json
import logging
import shutil
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from app.artifacts import PREFIX as ARTIFACTS
from app.jobs.keys import job_key
from app.jobs.parts import PartStore, parts_key
from maec_core.service.running import PhasedMerge, RunContext, phased
from tests.api.conftest import Api
from tests.api.test_resume import Shards, WorkerDied
from tests.factories import make_extended
from worker.runner import JobRunner
from worker.split import coordinate, help_parts

# Global key-row ranking and selection by ratio: both decided over the whole model.
PARAMS = {"rank_scope": "global", "selection": "ratio", "selection_ratio": 0.5,
          "key_ratio": 0.3}


def _body(api: Api) -> dict[str, object]:
    return api.named("maec", shard_size="20KB", parameters=PARAMS)


def _job(api: Api, jid: str) -> dict[str, Any]:
    job = api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json()
    assert job["status"] == "succeeded", job
    return dict(job)


def _outcome(api: Api, jid: str) -> tuple[dict[str, str], dict[str, Any], bool]:
    """A finished job's files (path -> sha256), its report without timings, and whether
    it reused its ability vector."""
    job = _job(api, jid)
    report = {k: v for k, v in job["result"]["report"].items()
              if k not in ("seconds", "stage_seconds")}
    return ({f["path"]: f["sha256"] for f in job["result"]["files"]}, report,
            job["artifact_reused"])


def _whole(api: Api, body: dict[str, object] | None = None
           ) -> tuple[dict[str, str], dict[str, Any], bool]:
    """The same merge run unsplit, extracting its ability vector afresh."""
    shutil.rmtree(api.settings.storage_dir / ARTIFACTS, ignore_errors=True)
    jid = str(api.submit(body or _body(api))["id"])
    settings = api.settings.model_copy(update={"split_above_bytes": 0})
    assert JobRunner(settings, api.worker_store(), api.storage()).run(jid) == "succeeded"
    return _outcome(api, jid)


class Counted:
    """A phased merge whose parts' and decisions' completed runs are counted; the
    ``die`` predicate, given (step, call number), makes the worker die in a step."""

    def __init__(self, die: Callable[[str, int], bool] = lambda _s, _n: False) -> None:
        self.die = die
        self.parts: list[tuple[int, int]] = []
        self.decided = 0
        self.calls = {"run_part": 0, "decide": 0}
        self._lock = threading.Lock()

    def wrap(self, real: PhasedMerge) -> PhasedMerge:
        counted = self

        class Wrapped:
            phases = real.phases

            def shard_count(self) -> int:
                return real.shard_count()

            def before(self, workdir: Any, ctx: RunContext) -> str:
                return real.before(workdir, ctx)

            def run_part(self, phase: int, part: tuple[int, int], records: Sequence[str],
                         ctx: RunContext) -> str:
                counted._enter("run_part")
                out = real.run_part(phase, part, records, ctx)
                with counted._lock:
                    counted.parts.append(part)
                return out

            def decide(self, phase: int, results: Sequence[str], records: Sequence[str],
                       ctx: RunContext) -> str:
                counted._enter("decide")
                out = real.decide(phase, results, records, ctx)
                counted.decided += 1
                return out

        return Wrapped()

    def _enter(self, step: str) -> None:
        with self._lock:
            self.calls[step] += 1
            n = self.calls[step]
        if self.die(step, n):
            raise WorkerDied


def _count(monkeypatch: pytest.MonkeyPatch, counted: Counted) -> None:
    """The split merge's phases (as worker.split asks for them) counted."""
    def counting(recipe: Any) -> PhasedMerge | None:
        p = phased(recipe)
        return None if p is None else counted.wrap(p)

    monkeypatch.setattr("worker.split.phased", counting)


def test_split_maec_job_publishes_the_unsplit_files_and_report(
        api_factory: Callable[..., Api], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.INFO, logger="maec.worker")
    api = api_factory(split_above_bytes=1, split_parts=3)
    counted = Counted()
    _count(monkeypatch, counted)
    jid = str(api.submit(_body(api))["id"])
    helpers: list[threading.Thread] = []

    def send_part(job: str) -> None:
        runner = JobRunner(api.settings, api.worker_store(), api.storage(),
                           worker=f"helper{len(helpers)}")
        t = threading.Thread(target=help_parts, args=(runner, job))
        helpers.append(t)
        t.start()

    coordinator = JobRunner(api.settings, api.worker_store(), api.storage(),
                            worker="coordinator", send_part=send_part, split=coordinate)
    assert coordinator.run(jid) == "succeeded"
    for t in helpers:
        t.join(30)
    assert f"job {jid}: split into 3 parts" in caplog.text
    # Each part scored once and combined once; the selection made once; helpers asked
    # for in each phase.
    assert sorted(counted.parts) == [(0, 2), (2, 4), (4, 6)]
    assert counted.decided == 1 and len(helpers) == 4
    for i in range(3):
        assert caplog.text.count(f"job {jid}: part {i} done with its phase 0") == 1
        assert caplog.text.count(f"job {jid}: part {i} done\n") == 1
    split_outcome = _outcome(api, jid)
    assert "maec_report.json" in split_outcome[0]
    assert split_outcome[2] is False  # extracted by this job, before its parts
    # The selection drops tensors: a decision the parts could not make alone.
    assert split_outcome[1]["abilities"][0]["tensors_dropped"]
    assert split_outcome == _whole(api)
    assert not api.r.exists(parts_key(jid))


def test_split_maec_job_over_an_extended_vocabulary_publishes_the_unsplit_files(
        api_factory: Callable[..., Api], caplog: pytest.LogCaptureFixture) -> None:
    """θL with tokens θ0 lacks: the key rows of the embedding and LM head move to θL's
    rows in every part's c_t and in its combination, as in the unsplit merge."""
    api = api_factory(split_above_bytes=1, split_parts=2)
    m = api.models
    lang = make_extended(api.root / "extra" / "lang", 3, like=m.base, words=["x0", "x1"],
                         added=["<lang>"])
    body: dict[str, object] = {"recipe": {
        "merge_method": "maec", "base_model": str(m.base), "language_base": str(lang),
        "abilities": [{"model": str(m.donor)}], "tokenizer_source": str(lang),
        "out_shard_size": "20KB",
        "parameters": {**PARAMS, "include": ["embed_tokens", "lm_head", r"\.layers\."]}}}
    jid = str(api.submit(body)["id"])
    caplog.set_level(logging.INFO, logger="maec.worker")
    assert JobRunner(api.settings, api.worker_store(), api.storage(),
                     split=coordinate).run(jid) == "succeeded"
    assert f"job {jid}: split into 2 parts" in caplog.text
    split_outcome = _outcome(api, jid)
    assert split_outcome[1]["vocabulary"]["tokens_added"] > 0
    assert split_outcome == _whole(api, body)


def test_a_scoring_part_whose_worker_dies_is_scored_again(
        api_factory: Callable[..., Api], monkeypatch: pytest.MonkeyPatch) -> None:
    api = api_factory(split_above_bytes=1, split_parts=3, lease_seconds=2)
    # The helper's worker dies in the first part it scores.
    counted = Counted(die=lambda step, n: step == "run_part" and n == 1)
    _count(monkeypatch, counted)
    jid = str(api.submit(_body(api))["id"])
    died: list[bool] = []

    def send_part(job: str) -> None:
        try:
            help_parts(JobRunner(api.settings, api.worker_store(), api.storage(),
                                 worker="helper"), job)
        except WorkerDied:
            died.append(True)

    coordinator = JobRunner(api.settings, api.worker_store(), api.storage(),
                            worker="coordinator", send_part=send_part, split=coordinate)
    assert coordinator.run(jid) == "succeeded"
    assert died == [True]
    # Four scoring runs began; each part's completed once, and the selection once.
    assert counted.calls["run_part"] == 4
    assert sorted(counted.parts) == [(0, 2), (2, 4), (4, 6)] and counted.decided == 1
    assert _outcome(api, jid) == _whole(api)


def test_a_combining_part_whose_worker_dies_keeps_its_recorded_shard(
        api_factory: Callable[..., Api], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="maec.worker")
    api = api_factory(split_above_bytes=1, split_parts=2, lease_seconds=2)
    jid = str(api.submit(_body(api))["id"])
    # The helper's worker dies after one shard of the part it combines has landed.
    dying = Shards(api.settings.storage_dir, die_at=1)
    died: list[bool] = []

    def send_part(job: str) -> None:
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
    assert dying.stored[0] not in second.stored  # verified and kept, not made again
    for i in range(2):  # each phase of each part completed once
        assert caplog.text.count(f"job {jid}: part {i} done with its phase 0") == 1
        assert caplog.text.count(f"job {jid}: part {i} done\n") == 1
    assert _outcome(api, jid) == _whole(api)


def test_a_coordinator_lost_between_phases_is_followed_by_one_that_keeps_the_scores(
        api_factory: Callable[..., Api], monkeypatch: pytest.MonkeyPatch) -> None:
    api = api_factory(split_above_bytes=1, split_parts=3, lease_seconds=2)
    # Every part scored, the coordinator dies as it is about to select.
    counted = Counted(die=lambda step, n: step == "decide" and n == 1)
    _count(monkeypatch, counted)
    jid = str(api.submit(_body(api))["id"])
    with pytest.raises(WorkerDied):
        JobRunner(api.settings, api.worker_store(), api.storage(), worker="dies",
                  split=coordinate).run(jid)
    assert len(counted.parts) == 3 and counted.decided == 0
    api.r.hset(job_key(jid), "lease_until", "0")  # the dead worker's lease has run out
    assert JobRunner(api.settings, api.worker_store(), api.storage(), worker="next",
                     split=coordinate).run(jid) == "succeeded"
    # The scores were kept: no part scored again; the selection made once.
    assert len(counted.parts) == 3 and counted.calls["run_part"] == 3
    assert counted.decided == 1
    assert _job(api, jid)["attempts"] == 2
    # The record of the ability vector made before the parts was kept too: the report
    # still says this job extracted it.
    assert _outcome(api, jid) == _whole(api)


def test_cancel_while_parts_score_leaves_nothing(api_factory: Callable[..., Api],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    api = api_factory(split_above_bytes=1, split_parts=2)
    jid = str(api.submit(_body(api))["id"])

    def cancel_in_first(step: str, n: int) -> bool:
        if step == "run_part" and n == 1:
            r = api.client.post(f"/v1/jobs/{jid}/cancel", headers=api.auth())
            assert r.status_code in (200, 202), r.text
        return False

    counted = Counted(die=cancel_in_first)
    _count(monkeypatch, counted)
    coordinator = JobRunner(api.settings, api.worker_store(), api.storage(),
                            worker="coordinator", split=coordinate)
    assert coordinator.run(jid) == "cancelled"
    assert counted.parts == [] and counted.decided == 0  # stopped in its first part
    assert not api.r.exists(parts_key(jid))
    assert not list((api.settings.storage_dir / "jobs" / jid).rglob("*.safetensors"))


def test_a_phase_begins_once_when_every_part_is_done_with_attempts_of_its_own(
        api_factory: Callable[..., Api]) -> None:
    store = PartStore(api_factory().r)
    assert store.create("j", "jobs/j/a1", [(0, 1), (1, 2)], phases=2, before="found")

    def claim(now: float) -> tuple[int, int]:
        return store.claim("j", worker="w", lease_s=60.0, now=now, max_attempts=2)

    assert claim(0) == (0, 1)
    assert claim(0) == (1, 1)
    c = 1 / 3  # its 17 significant digits survive the store (Redis's codec keeps 14)
    assert store.finish("j", 0, 1, json.dumps({"c": c}))
    assert store.advance("j", 0, "decided") == -1  # part 1 is not done
    assert store.finish("j", 1, 1, "{}")
    state = store.get("j")
    assert state is not None and state.phase_done and not state.done
    assert json.loads(state.parts[0].result or "")["c"] == c
    assert state.records == ["found"] and state.fraction == 0.5
    assert store.advance("j", 0, "decided") == 1
    assert store.advance("j", 0, "decided again") == 0  # begun once
    state = store.get("j")
    assert state is not None and state.phase == 1 and state.last_phase and not state.done
    assert state.records == ["found", "decided"]
    assert [(p.state, p.result) for p in state.parts] == [("pending", None)] * 2
    assert not store.update("j", 0, 1, {"fraction": 0.5})  # the last phase's holder only
    # Attempt numbers go on; the phase has max_attempts of its own.
    assert claim(0) == (0, 2)
    assert claim(100) == (0, 3)
    assert claim(200) == (-2, 0)
    state = store.get("j")
    assert state is not None and state.parts[0].state == "failed"
    assert state.parts[0].attempt - state.parts[0].base == 2  # its phase's tries
