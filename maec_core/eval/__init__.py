"""Evaluation of merged models: perplexity and task accuracy per eval set and language.

This package's own import, :mod:`~maec_core.eval.sets` (specs and set files),
:mod:`~maec_core.eval.answers` and :mod:`~maec_core.eval.report` are torch-free, so the
API can check eval specs at submission. Measuring lives in
:mod:`maec_core.eval.runner` (``evaluate``, ``evaluate_many``) and
:mod:`maec_core.eval.measure`, which import torch and transformers.
"""

from __future__ import annotations

from maec_core.eval.answers import extract_answer, is_correct, parse_number
from maec_core.eval.report import EvalReport, read_report, write_report
from maec_core.eval.sets import (
    EvalSetSpec,
    EvalSpec,
    LoadedSet,
    load_set,
    load_sets,
    load_spec,
    parse_spec,
)

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
