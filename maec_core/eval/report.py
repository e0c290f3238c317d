"""Eval results: every item kept, read as a table (rows models, columns eval sets).

Torch-free, so the API and the client-side tooling can read ``eval_report.json`` back
(:func:`read_report`) and render it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

REPORT_VERSION = 1


class AccuracyItem(BaseModel):
    """One question: what the model saw, what it wrote, and how it was scored."""

    model_config = ConfigDict(frozen=True)

    index: int
    question: str
    answer: str
    prompt: str
    output: str
    extracted: str | None
    correct: bool
    output_tokens: int


class DocumentScore(BaseModel):
    """One document of a perplexity set: scored tokens and their summed NLL (nats)."""

    model_config = ConfigDict(frozen=True)

    index: int
    tokens: int
    nll: float


Kind = Literal["perplexity", "accuracy", "lm_eval"]


class SetResult(BaseModel):
    name: str
    language: str
    kind: Kind
    # Perplexity: exp(token-weighted mean NLL). Accuracy: correct / items. lm_eval: the
    # lm-eval metric named by ``metric``.
    value: float
    # Perplexity: scored tokens. Accuracy and lm_eval: items.
    count: int
    correct: int | None = None
    mean_nll: float | None = None
    seconds: float
    # The values actually used (defaults filled in, per-model choices such as context).
    settings: dict[str, Any] = Field(default_factory=dict)
    items: list[AccuracyItem] = Field(default_factory=list)
    documents: list[DocumentScore] = Field(default_factory=list)
    # lm_eval: the metric ``value`` is, and every metric (and its standard error) under
    # lm-eval's own name ("acc", "acc_norm", "exact_match,flexible-extract").
    metric: str | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    stderr: dict[str, float] = Field(default_factory=dict)

    def cell(self) -> str:
        if self.kind == "lm_eval":
            return f"{self.metric} {self.value:.3f} (n={self.count})"
        if self.kind == "accuracy":
            return f"acc {self.value:.3f} ({self.correct}/{self.count})"
        return f"ppl {self.value:.4g}"


class ModelResult(BaseModel):
    label: str
    # The folder scored; in a job's published report an input's reference, and None for
    # the job's own outputs (sweep.attach.published_report).
    model_dir: str | None
    device: str
    dtype: str
    seconds: float
    sets: list[SetResult]

    def result(self, name: str) -> SetResult | None:
        return next((s for s in self.sets if s.name == name), None)


class Column(BaseModel):
    name: str
    language: str
    kind: Kind
    # lm_eval: the lm-eval metric the column shows (the other kinds' metric is the kind).
    metric: str | None = Field(default=None, exclude=True)

    @property
    def header(self) -> str:
        return f"{self.name} [{self.language}]"


class EvalReport(BaseModel):
    version: int = REPORT_VERSION
    models: list[ModelResult]

    @property
    def columns(self) -> list[Column]:
        """Eval sets in first-seen order across the models."""
        seen: dict[str, Column] = {}
        for m in self.models:
            for s in m.sets:
                seen.setdefault(s.name, Column(name=s.name, language=s.language, kind=s.kind,
                                               metric=s.metric))
        return list(seen.values())

    @computed_field  # type: ignore[prop-decorator]
    @property
    def table(self) -> dict[str, Any]:
        """Rows models, columns eval sets, each cell the set's metric value (or null); a
        row with lm_eval sets also lists each one's metrics under lm-eval's names."""
        cols = self.columns
        rows = []
        for m in self.models:
            cells: dict[str, float | None] = {}
            for c in cols:
                r = m.result(c.name)
                cells[c.name] = r.value if r is not None else None
            row: dict[str, Any] = {"model": m.label, "cells": cells}
            lm_eval = {s.name: s.metrics for s in m.sets if s.kind == "lm_eval"}
            if lm_eval:
                row["lm_eval"] = lm_eval
            rows.append(row)
        columns = [{**c.model_dump(), "metric": c.metric or c.kind} for c in cols]
        return {"columns": columns, "rows": rows}

    def _grid(self) -> tuple[list[str], list[list[str]]]:
        cols = self.columns
        header = ["model", *(c.header for c in cols)]
        body = []
        for m in self.models:
            row = [m.label]
            for c in cols:
                r = m.result(c.name)
                row.append(r.cell() if r is not None else "-")
            body.append(row)
        return header, body

    def text_table(self) -> str:
        """Aligned plain text, for a terminal."""
        header, body = self._grid()
        widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

        def line(cells: list[str]) -> str:
            return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

        rule = "  ".join("-" * w for w in widths)
        return "\n".join([line(header), rule, *(line(r) for r in body)]) + "\n"

    def markdown_table(self) -> str:
        """A GitHub-flavoured markdown table, for model cards."""
        header, body = self._grid()

        def line(cells: list[str]) -> str:
            return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

        rule = "|" + "|".join(" --- " for _ in header) + "|"
        return "\n".join([line(header), rule, *(line(r) for r in body)]) + "\n"


def write_report(report: EvalReport, path: str | Path) -> Path:
    """Write ``eval_report.json`` (every item of every set), atomically."""
    out = Path(path)
    tmp = out.with_name(out.name + ".partial")
    tmp.write_text(json.dumps(report.model_dump(mode="json"), indent=1, ensure_ascii=False)
                   + "\n", encoding="utf-8")
    os.replace(tmp, out)
    return out


def read_report(path: str | Path) -> EvalReport:
    # The stored table is derived from the models; validation recomputes it.
    return EvalReport.model_validate_json(Path(path).read_bytes())
