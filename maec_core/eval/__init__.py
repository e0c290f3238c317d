"""Evaluation of merged models: perplexity and task accuracy per eval set and language.

This package's own import, :mod:`~maec_core.eval.sets` (specs and set files),
:mod:`~maec_core.eval.answers` and :mod:`~maec_core.eval.report` are torch-free, so the
API can check eval specs at submission. Measuring lives in
:mod:`maec_core.eval.runner` (``evaluate``, ``evaluate_many``) and
:mod:`maec_core.eval.measure`, which import torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from maec_core.eval.answers import extract_answer, is_correct, parse_number
from maec_core.eval.sets import (
    EvalSetSpec,
    EvalSpec,
    LoadedSet,
    load_set,
    load_sets,
    load_spec,
    parse_spec,
)

if TYPE_CHECKING:
    from maec_core.eval.report import EvalReport, read_report, write_report

# The report's names, imported from :mod:`~maec_core.eval.report` on first use: every
# recipe imports this package (for its eval sets), few processes write a report.
_REPORT = frozenset({"EvalReport", "read_report", "write_report"})

__all__ = [
    "EvalReport",
    "EvalSetSpec",
    "EvalSpec",
    "LoadedSet",
    "extract_answer",
    "is_correct",
    "load_set",
    "load_sets",
    "load_spec",
    "parse_number",
    "parse_spec",
    "read_report",
    "write_report",
]


def __getattr__(name: str) -> Any:
    if name not in _REPORT:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("maec_core.eval.report"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_REPORT})
