"""The leaderboard: every candidate with its parameters and scores, the winner and why.

Torch-free: built from the eval report's values, written as ``leaderboard.json`` and read
back by anyone (:func:`read_leaderboard`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from maec_core.errors import NoFeasibleCandidate
from maec_core.eval.report import EvalReport
from maec_core.recipe.sweep import SweepSpec

LEADERBOARD_NAME = "leaderboard.json"
LEADERBOARD_VERSION = 1


class Row(BaseModel):
    """One candidate: knob values, every eval set's value, and how it fared."""

    model_config = ConfigDict(extra="forbid")

    id: str
    values: dict[str, int | float]
    scores: dict[str, float]
    objective: float
    feasible: bool = True
    rank: int | None = None
    extracted: bool = False
    seconds: float = 0.0


class Residency(BaseModel):
    """What a MAEC sweep held in memory for its candidates' merges (read from disk once)
    instead of reading it from disk for each candidate (``maec_core.sweep.memory``)."""

    model_config = ConfigDict(extra="forbid")

    # The language base's tensor bytes were held for every candidate's merge.
    language_base: bool
    language_base_bytes: int
    # Extraction groups whose stored ability vectors were held for their later candidates.
    ability_vector_groups: int = 0
    # The memory the sweep allowed itself for that (what did not fit was read from disk).
    budget_bytes: int

    def sentence(self) -> str:
        mb = self.language_base_bytes / 1e6
        budget = self.budget_bytes / 1e6
        if self.language_base:
            return (f"The language base ({mb:.1f} MB) was held in memory and read from disk "
                    f"once for all candidates (memory budget {budget:.1f} MB).")
        return (f"The language base ({mb:.1f} MB) was read from disk for each candidate: "
                f"it does not fit the memory budget ({budget:.1f} MB).")


class Leaderboard(BaseModel):
    version: int = LEADERBOARD_VERSION
    knobs: list[str]
    objective: dict[str, Any]
    constraint: dict[str, Any] | None = None
    tie_break: dict[str, Any] | None = None
    # The reference inputs' values on the constraint set (e.g. language_base).
    reference: dict[str, float] = Field(default_factory=dict)
    rows: list[Row]
    winner: str | None
    why: str
    extractions: int = 0
    publish: Literal["best", "all"] = "best"
    # What the sweep held in memory for all candidates (None: nothing to hold, no MAEC).
    resident: Residency | None = None

    def row(self, cid: str) -> Row:
        return next(r for r in self.rows if r.id == cid)

    def markdown(self) -> str:
        """A markdown table of the candidates, best first, the winner in bold."""
        sets = list(self.rows[0].scores) if self.rows else []
        header = ["rank", "candidate", *self.knobs, *sets, "meets constraint"]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for r in sorted(self.rows, key=lambda r: (r.rank is None, r.rank or 0, r.id)):
            cid = f"**{r.id}**" if r.id == self.winner else r.id
            cells = [str(r.rank) if r.rank is not None else "-", cid,
                     *(f"{r.values[k]:g}" for k in self.knobs),
                     *(f"{r.scores[s]:.4g}" for s in sets),
                     "yes" if r.feasible else "no"]
            lines.append("| " + " | ".join(cells) + " |")
        if self.resident is not None:
            lines += ["", self.resident.sentence()]
        return "\n".join(lines) + "\n"


def score_rows(report: EvalReport, ids: list[str], values: dict[str, dict[str, Any]],
               spec: SweepSpec, reference: dict[str, float]) -> list[Row]:
    """Rows for the candidates ``ids`` (labels in ``report``), constraint applied."""
    rows = []
    for cid in ids:
        model = next(m for m in report.models if m.label == cid)
        scores = {s.name: s.value for s in model.sets}
        rows.append(Row(id=cid, values=values[cid], scores=scores,
                        objective=scores[spec.objective.set],
                        feasible=_meets(spec, scores, reference), seconds=model.seconds))
    return rows


def _meets(spec: SweepSpec, scores: dict[str, float], reference: dict[str, float]) -> bool:
    c = spec.constraint
    if c is None:
        return True
    value = scores[c.set]
    sense, bound = c.limit(reference.get(c.set))
    if math.isnan(value):
        return False
    return value <= bound if sense == "max" else value >= bound


def _signed(value: float, goal: Literal["max", "min"]) -> float:
    """``value`` as a cost (lower is better); a NaN ranks last."""
    if math.isnan(value):
        return math.inf
    return -value if goal == "max" else value


def sort_key(row: Row, spec: SweepSpec, index: int) -> tuple[float, float, int]:
    """A feasible row's place in the ranking (lower is better): the objective, then the
    tie-break metric when the spec gives one, then ``index``, its grid order."""
    second = 0.0
    tb = spec.tie_break
    if tb is not None:
        second = _signed(row.scores.get(tb.set, math.nan), tb.direction)
    return _signed(row.objective, spec.objective.direction), second, index


def rank(rows: list[Row], spec: SweepSpec, reference: dict[str, float]) -> tuple[str, str]:
    """Rank the feasible rows in place (1 = best; ties go to ``tie_break``, then grid
    order); the winner's id and why it won. NoFeasibleCandidate when the constraint
    leaves none."""
    goal = spec.objective.direction
    feasible = [r for r in rows if r.feasible and not math.isnan(r.objective)]
    c = spec.constraint
    bound = c.describe(reference.get(c.set)) if c is not None else ""
    if not feasible:
        raise NoFeasibleCandidate(
            f"no candidate of the sweep meets the constraint {bound}",
            constraint=bound, candidates={r.id: r.scores for r in rows})
    ordered = sorted(feasible, key=lambda r: sort_key(r, spec, rows.index(r)))
    for i, r in enumerate(ordered, 1):
        r.rank = i
    best = ordered[0]
    obj = spec.objective
    why = ("highest" if goal == "max" else "lowest") + (
        f" {obj.metric} on {obj.set} ({best.objective:.4g}) of {len(feasible)} candidate(s)")
    if c is not None:
        excluded = len(rows) - len(feasible)
        why += f" meeting {bound}; {excluded} excluded by the constraint"
    tied = [r for r in ordered[1:] if r.objective == best.objective]
    tb = spec.tie_break
    if tied:
        how = "grid order"
        if tb is not None and sort_key(tied[0], spec, 0)[1] != sort_key(best, spec, 0)[1]:
            how = (f"{tb.metric} on {tb.set} ({best.scores[tb.set]:.4g} against "
                   f"{tied[0].scores[tb.set]:.4g})")
        why += f"; tied with {len(tied)} candidate(s), decided by {how}"
    if len(ordered) > 1:
        why += f"; runner-up {ordered[1].id} ({ordered[1].objective:.4g})"
    return best.id, why


def write_leaderboard(board: Leaderboard, path: str | Path) -> Path:
    out = Path(path)
    tmp = out.with_name(out.name + ".partial")
    tmp.write_text(json.dumps(board.model_dump(mode="json"), indent=1) + "\n")
    os.replace(tmp, out)
    return out


def read_leaderboard(path: str | Path) -> Leaderboard:
    return Leaderboard.model_validate_json(Path(path).read_bytes())
