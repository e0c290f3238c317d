"""What a job does between fetching its inputs and publishing: merge, evaluate, or sweep.

``produce`` runs the recipe (already pointing at local inputs and eval sets) into ``out``
and answers what the runner publishes: the folder's manifest and the result fields the
job gains (``evaluation``, ``sweep``). A sweep with ``publish: all`` uploads each
candidate under ``candidates/<id>/`` of the job's prefix as it finishes, through
``upload``, so no more than one candidate waits on disk besides the best.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from maec_core.service import EvalReport, Recipe, candidate_at, write_manifest
from maec_core.service.running import EngineOptions, RunContext

# upload(path under the job's prefix, local file): one file into the job's staging prefix.
Upload = Callable[[str, Path], None]
# A folder's manifest as clients see it (``maec_core.job_plan.JobPlan.published``).
Published = Callable[[dict[str, Any]], dict[str, Any]]


class Reporter(Protocol):
    """The attempt's progress writer (``worker.runner.Attempt``)."""

    def report(self, stage: str, fraction: float, done: int, total: int,
               **extra: Any) -> None: ...


@dataclass
class Produced:
    manifest: dict[str, Any]
    report: dict[str, Any]
    stage_seconds: dict[str, float]
    core_seconds: float
    reused: list[bool]
    # Result fields the job gains (evaluation, sweep) and files already uploaded.
    result: dict[str, Any] = field(default_factory=dict)
    files: list[dict[str, Any]] = field(default_factory=list)


def evaluation_result(report: EvalReport, label: str) -> dict[str, Any]:
    return {"label": label, "report": "eval_report.json", "table": report.table}


def produce(recipe: Recipe, out: Path, ctx: RunContext, *, work_dir: Path,
            reporter: Reporter, upload: Upload, published: Published) -> Produced:
    """Merge (and evaluate, or sweep) ``recipe`` into ``out``. ``ctx.options`` (the
    output's finished-shard callbacks) apply to a plain merge only: a sweep's candidates
    are not the output. ``published`` names a candidate's inputs in the manifest it
    publishes."""
    if recipe.sweep is not None:
        return _sweep(recipe, out, ctx.but(options=EngineOptions()), work_dir=work_dir,
                      reporter=reporter, upload=upload, published=published)
    from maec_core.service.running import evaluate_folder, run

    merged = run(recipe.merge_only(), out, ctx)
    report = merged.report or {}
    produced = Produced(merged.manifest, report, merged.stage_seconds, merged.seconds,
                        [bool(a.get("artifact_reused")) for a in report.get("abilities", [])])
    if recipe.evaluate:
        evaluated = evaluate_folder(recipe, out, ctx)
        produced.manifest = evaluated.manifest
        produced.result["evaluation"] = evaluation_result(evaluated.report, "merged")
    return produced


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


def _sweep(recipe: Recipe, out: Path, ctx: RunContext, *, work_dir: Path,
           reporter: Reporter, upload: Upload, published: Published) -> Produced:
    from maec_core.service import Candidate
    from maec_core.service.running import SweepOptions, run_sweep

    track = SweepProgress(reporter)
    uploaded: list[dict[str, Any]] = []
    where: dict[str, str] = {}

    def keep(cand: Candidate, folder: Path, manifest: dict[str, Any]) -> None:
        prefix = f"candidates/{cand.id}"
        entries = [*manifest["files"], write_manifest(folder, published(manifest))]
        for f in entries:
            upload(f"{prefix}/{f['path']}", folder / f["path"])
            uploaded.append({**f, "path": f"{prefix}/{f['path']}"})
        where[cand.id] = prefix + "/"

    result = run_sweep(recipe, out, ctx.but(progress=track), SweepOptions(
        work_dir=work_dir, keep=keep, announce=track.announce))
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

