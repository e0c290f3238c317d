"""How a job's stages share its progress fraction: the stage tables and the arithmetic.

A job's record shows one ``fraction`` of the whole job (0 to 1) and the current stage's
``done``/``total``. Each stage covers a span of the fraction; which spans a job has
depends on whether its method extracts (a stage of its own) and whether it evaluates.
A sweep spreads its candidates (each: extract, combine, evaluate) over one span in the
middle. Torch-free: the job plan (``maec_core.job_plan``) carries the job's spans.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

Span = tuple[float, float]

# Engine stage names -> the contract's stage names.
ALIASES: Mapping[str, str] = {"merge": "combine", "select": "combine"}

_MERGE: Mapping[str, Span] = {"fetch": (0.0, 0.05), "extract": (0.05, 0.5),
                              "combine": (0.5, 0.95), "publish": (0.95, 1.0)}
_MERGE_NO_EXTRACT: Mapping[str, Span] = {**_MERGE, "combine": (0.05, 0.95)}
_EVAL: Mapping[str, Span] = {"fetch": (0.0, 0.05), "extract": (0.05, 0.45),
                             "combine": (0.45, 0.8), "evaluate": (0.8, 0.95),
                             "publish": (0.95, 1.0)}
_EVAL_NO_EXTRACT: Mapping[str, Span] = {**_EVAL, "combine": (0.05, 0.8)}
# Within one sweep candidate; the sweep as a whole covers SWEEP_SPAN of the job.
_CANDIDATE: Mapping[str, Span] = {"extract": (0.0, 0.4), "combine": (0.4, 0.7),
                                  "evaluate": (0.7, 1.0)}
SWEEP_SPAN: Span = (0.05, 0.95)


def stage_name(stage: str) -> str:
    """The contract's name of an engine stage."""
    return ALIASES.get(stage, stage)


def _within(span: Span, done: int, total: int) -> float:
    lo, hi = span
    return lo + (hi - lo) * (done / total if total else 1.0)


@dataclass(frozen=True)
class StageSpans:
    """The share of the job's fraction each of its stages covers."""

    spans: Mapping[str, Span]

    def at(self, stage: str, done: int, total: int) -> tuple[str, float]:
        """(contract stage name, fraction of the whole job) at ``done`` of ``total``."""
        stage = stage_name(stage)
        return stage, _within(self.spans.get(stage, (0.0, 1.0)), done, total)


def job_spans(*, extracts: bool, evaluates: bool) -> StageSpans:
    """The spans of a job whose method has an extract stage (``extracts``) and which
    evaluates its output (``evaluates``; a sweep's evaluation is its candidates')."""
    if evaluates:
        return StageSpans(_EVAL if extracts else _EVAL_NO_EXTRACT)
    return StageSpans(_MERGE if extracts else _MERGE_NO_EXTRACT)


def candidate_at(stage: str, done: int, total: int, slot: int, slots: int
                 ) -> tuple[str, float]:
    """A sweep's progress: (stage name, fraction of the whole job) with slot ``slot`` of
    ``slots`` (slot 0 scores the reference inputs, slot i + 1 is candidate i) at
    ``done`` of ``total`` of its ``stage``."""
    stage = stage_name(stage)
    inner = _within(_CANDIDATE.get(stage, (0.0, 1.0)), done, total)
    a, b = SWEEP_SPAN
    return stage, a + (b - a) * (min(slot, slots - 1) + inner) / slots
