"""The merge job kind: a recipe merged, evaluated, or swept (``worker.job_kind``).

:meth:`MergeJob.produce` runs the recipe (pointing at the fetched inputs and eval sets)
into ``out`` and answers what the runner publishes: the folder's manifest, inputs named
by the recipe's references, and the result fields the job gains (``evaluation``,
``sweep``). A sweep with ``publish: all`` uploads each
candidate under ``candidates/<id>/`` of the job's prefix as it finishes, through
``Run.upload``, so no more than one candidate waits on disk besides the best.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.jobs.record import JobRecord
from maec_core.service import (
    EvalReport,
    FileEntry,
    JobPlan,
    Manifest,
    Recipe,
    StageSpans,
    candidate_at,
    parse_recipe,
    plan_job,
    published_manifest,
)
from maec_core.service.running import EngineOptions, RunContext
from worker.gguf import check_before_merge, with_gguf_output
from worker.job_kind import Made, Reporter, Run
from worker.resume import resumable


@dataclass
class Produced:
    """What the merge (and its evaluation, or the sweep) made, inputs named by reference
    (the run was given ``RunContext.names``)."""

    manifest: Mapping[str, Any]
    report: dict[str, Any]
    stage_seconds: dict[str, float]
    core_seconds: float
    reused: list[bool]
    # Result fields the job gains (evaluation, sweep) and files already uploaded.
    result: dict[str, Any] = field(default_factory=dict)
    files: list[FileEntry] = field(default_factory=list)


def evaluation_result(report: EvalReport, label: str) -> dict[str, Any]:
    return {"label": label, "report": "eval_report.json", "table": report.table}


@dataclass(frozen=True)
class MergeJob:
    """One merge, evaluated merge or sweep, planned once from its recipe."""

    plan: JobPlan

    @property
    def spans(self) -> StageSpans:
        return self.plan.spans

    def one_file(self, ref: str) -> bool:
        return self.plan.one_file(ref)

    @property
    def resumable(self) -> bool:
        return resumable(self.plan)

    def check(self, local: Mapping[str, str]) -> None:
        self.plan.adapters.check(local)
        check_before_merge(self.plan.localised(local))

    def produce(self, run: Run) -> Made:
        # Each local copy's reference, given to the run once: it records references where
        # it would record a copy (recipe.yaml, card, every manifest, the report).
        named = Naming(self.plan.inputs, run.local, run.ctx.hash_cache, run.digests)
        ctx = run.ctx.but(names=self.plan.names(run.local))
        made = produce(self.plan.localised(run.local), run.out, ctx, named, run)
        reused = all(made.reused) if self.plan.extracts and made.reused else None
        # A GGUF input's provenance and the GGUF copy the recipe asks for (worker.gguf)
        # join the manifest in memory, before the runner writes it.
        manifest = Manifest.of(with_gguf_output(run.out, named.manifest(made.manifest).doc,
                                                self.plan.recipe, run.local))
        return Made(manifest,
                    _summary(made.report, made.stage_seconds),
                    made.core_seconds, made.result, tuple(made.files), reused)


@dataclass(frozen=True)
class Naming:
    """How a job's folders are published: each input by its reference with every file's
    sha256, read from its local copy (``local``: reference -> local copy) unless
    ``known`` gives it."""

    inputs: tuple[str, ...]
    local: Mapping[str, str]
    hash_cache: Path | None
    # Digests known without reading the local copy (inputs held in part).
    known: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def manifest(self, manifest: Mapping[str, Any]) -> Manifest:
        """A folder's manifest (as the run returned it, named by reference) as clients
        see it."""
        return Manifest.of(published_manifest(manifest, self.inputs, self.local,
                                              self.hash_cache, self.known))


class MergeKind:
    """Every record another kind does not own: its recipe is a merge recipe."""

    def plan(self, rec: JobRecord) -> MergeJob:
        # The recipe is parsed once from the job record and planned once; the plan is
        # carried through the stages: fetch, merge (and evaluate), publish.
        return MergeJob(plan_job(parse_recipe(rec.recipe)))


MERGE = MergeKind()


def produce(recipe: Recipe, out: Path, ctx: RunContext, named: Naming, run: Run
            ) -> Produced:
    """Merge (and evaluate, or sweep) ``recipe`` into ``out``. ``ctx.options`` (the
    output's finished-shard callbacks) apply to a plain merge only: a sweep's candidates
    are not the output. ``named`` names a candidate's inputs in the manifest it
    publishes."""
    if recipe.sweep is not None:
        return _sweep(recipe, out, ctx.but(options=EngineOptions()), named, run)
    from maec_core.service.running import evaluate_folder
    from maec_core.service.running import run as run_recipe

    merged = run_recipe(recipe.merge_only(), out, ctx)
    report = merged.report or {}
    produced = Produced(merged.manifest, report, merged.stage_seconds, merged.seconds,
                        [bool(a.get("artifact_reused")) for a in report.get("abilities", [])])
    if recipe.evaluate:
        evaluated = evaluate_folder(recipe, out, ctx, manifest=merged.manifest)
        produced.manifest = evaluated.manifest
        produced.result["evaluation"] = evaluation_result(evaluated.report, "merged")
    return produced


def _summary(report: dict[str, Any], stage_seconds: dict[str, float]) -> dict[str, Any]:
    """The job's report: the engine's summary plus stage timings. The per-tensor table
    stays in the published maec_report.json, keeping job reads small."""
    out = {k: v for k, v in report.items() if k != "tensors"}
    out["stage_seconds"] = {k: round(v, 4) for k, v in stage_seconds.items()}
    return out


class SweepProgress:
    """Maps each candidate's stages onto the job's fraction: slot 0 scores the
    reference inputs, slot i + 1 is candidate i."""

    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter
        self.slot = 0
        self.slots = 1

    def announce(self, index: int, total: int) -> None:
        self.slot, self.slots = index + 1, total + 1

    def __call__(self, stage: str, done: int, total: int) -> None:
        stage, frac = candidate_at(stage, done, total, self.slot, self.slots)
        self.reporter.report(stage, frac, done, total, candidate=self.slot,
                             candidates=self.slots - 1)


def _sweep(recipe: Recipe, out: Path, ctx: RunContext, named: Naming, run: Run
           ) -> Produced:
    from maec_core.service import Candidate
    from maec_core.service.running import SweepOptions, run_sweep

    track = SweepProgress(run.reporter)
    uploaded: list[FileEntry] = []
    where: dict[str, str] = {}

    def keep(cand: Candidate, folder: Path, manifest: dict[str, Any]) -> None:
        prefix = f"candidates/{cand.id}"
        published = named.manifest(manifest)
        for f in (*published.files, published.write(folder)):
            run.upload(f"{prefix}/{f.path}", folder / f.path)
            uploaded.append(f.under(prefix))
        where[cand.id] = prefix + "/"

    result = run_sweep(recipe, out, ctx.but(progress=track), SweepOptions(
        work_dir=run.workdir, keep=keep, announce=track.announce))
    board = result.board
    summary = {**board.model_dump(mode="json", exclude={"version"}), "candidates": where}
    return Produced(
        result.manifest, {"sweep": {"candidates": len(board.rows),
                                    "extractions": result.extractions}},
        {"sweep": result.seconds}, result.seconds,
        # Reused when no candidate had to extract (for a method that extracts: the
        # runner's plan knows).
        [result.extractions == 0],
        result={"evaluation": evaluation_result(result.report, board.winner or ""),
                "sweep": summary},
        files=uploaded)
