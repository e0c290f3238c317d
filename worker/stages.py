"""What a job does between fetching its inputs and publishing: merge, evaluate, or sweep.

``produce`` runs the recipe (already pointing at local inputs and eval sets) into ``out``
and answers what the runner publishes: the folder's manifest and the result fields the
job gains (``evaluation``, ``sweep``). A sweep with ``publish: all`` uploads each
candidate under ``candidates/<id>/`` of the job's prefix as it finishes, through
``upload``, so no more than one candidate waits on disk besides the best.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from maec_core.context import RunContext
from maec_core.eval.report import EvalReport
from maec_core.manifest import MANIFEST_NAME
from maec_core.methods import get_method
from maec_core.recipe import Recipe
from maec_core.runtime import EngineOptions

# Fraction of the whole job each stage covers, for a job that evaluates.
EVAL_SPAN = {"fetch": (0.0, 0.05), "extract": (0.05, 0.45), "combine": (0.45, 0.8),
             "evaluate": (0.8, 0.95), "publish": (0.95, 1.0)}
EVAL_SPAN_NO_EXTRACT = {**EVAL_SPAN, "combine": (0.05, 0.8)}
# Within one sweep candidate (the sweep as a whole covers SWEEP_SPAN of the job).
CANDIDATE_SPAN = {"extract": (0.0, 0.4), "combine": (0.4, 0.7), "evaluate": (0.7, 1.0)}
SWEEP_SPAN = (0.05, 0.95)
ALIASES = {"merge": "combine", "select": "combine"}

# upload(path under the job's prefix, local file): one file into the job's staging prefix.
Upload = Callable[[str, Path], None]


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


def extracts(recipe: Recipe) -> bool:
    """Whether the recipe's method has an extraction stage (its progress spans differ)."""
    return "extract" in get_method(recipe.merge_method).stages


def spans_for(recipe: Recipe) -> dict[str, tuple[float, float]] | None:
    """The stage spans of a job that evaluates (None: the runner's defaults)."""
    if not recipe.evaluate or recipe.sweep is not None:
        return None
    return EVAL_SPAN if extracts(recipe) else EVAL_SPAN_NO_EXTRACT


def evaluation_result(report: EvalReport, label: str) -> dict[str, Any]:
    return {"label": label, "report": "eval_report.json", "table": report.table}


def produce(recipe: Recipe, out: Path, ctx: RunContext, *, work_dir: Path,
            reporter: Reporter, upload: Upload) -> Produced:
    """Merge (and evaluate, or sweep) ``recipe`` into ``out``. ``ctx.options`` (the
    output's finished-shard callbacks) apply to a plain merge only: a sweep's candidates
    are not the output."""
    if recipe.sweep is not None:
        return _sweep(recipe, out, ctx.but(options=EngineOptions()), work_dir=work_dir,
                      reporter=reporter, upload=upload)
    from maec_core.run import run
    from maec_core.sweep.runner import evaluate_folder

    merged = run(recipe.merge_only(), out, ctx)
    report = merged.report or {}
    produced = Produced(merged.manifest, report, merged.stage_seconds, merged.seconds,
                        [bool(a.get("artifact_reused")) for a in report.get("abilities", [])])
    if recipe.evaluate:
        evaluated = evaluate_folder(recipe, out, ctx)
        produced.manifest = json.loads((out / MANIFEST_NAME).read_text())
        produced.result["evaluation"] = evaluation_result(evaluated, "merged")
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
        stage = ALIASES.get(stage, stage)
        lo, hi = CANDIDATE_SPAN.get(stage, (0.0, 1.0))
        inner = lo + (hi - lo) * (done / total if total else 1.0)
        a, b = SWEEP_SPAN
        frac = a + (b - a) * (min(self.slot, self.slots - 1) + inner) / self.slots
        self.reporter.report(stage, frac, done, total, candidate=self.slot,
                             candidates=self.slots - 1)


def _sweep(recipe: Recipe, out: Path, ctx: RunContext, *, work_dir: Path,
           reporter: Reporter, upload: Upload) -> Produced:
    from maec_core.sweep.grid import Candidate
    from maec_core.sweep.runner import SweepOptions, run_sweep

    track = SweepProgress(reporter)
    uploaded: list[dict[str, Any]] = []
    where: dict[str, str] = {}

    def keep(cand: Candidate, folder: Path, manifest: dict[str, Any]) -> None:
        prefix = f"candidates/{cand.id}"
        entries = [*manifest["files"], _manifest_entry(folder)]
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
        # A method that extracts: reused when no candidate had to extract.
        [result.extractions == 0] if extracts(recipe) else [],
        result={"evaluation": evaluation_result(result.report, board.winner or ""),
                "sweep": summary},
        files=uploaded)


def _manifest_entry(folder: Path) -> dict[str, Any]:
    from maec_core.checksums import sha256_file

    path = folder / MANIFEST_NAME
    return {"path": MANIFEST_NAME, "size": path.stat().st_size,
            "sha256": sha256_file(path, use_cache=False)}
