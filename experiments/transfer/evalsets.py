"""Eval sets as files, scored by the project's evaluation library (``maec_core.eval``).

Each seed's held-out items and documents are written once as JSONL eval sets; every model
(single checkpoints and every merge candidate) is scored by ``maec_core.eval.evaluate`` on
an :class:`~maec_core.eval.EvalSpec` over those files, the same code ``maec eval`` runs.

Accuracy: the prompt is the problem as it is trained (``{question}``, BOS prepended by the
tokenizer), greedy decoding of at most two new tokens (the answer and end of sequence), the
last number of the output compared exactly with the gold answer (MGSM's rule).
Perplexity: one window per document (documents are shorter than the model's context).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from maec_core.eval import EvalSetSpec, EvalSpec

# BCP-47 private-use codes for the synthetic languages (the eval library wants a code).
LANG_CODE = {"S": "qaa", "T": "qab", "R": "qac", "X": "qad"}
# The model's position limit; every document fits in one window.
CONTEXT = 64
# Rows per forward pass. On a CPU core, 32 rows of these short prompts keep a layer's
# activations in cache; 256 spilled them and scored the same values 15-25% slower.
BATCH = 32


def write_jsonl(path: Path, rows: Sequence[dict[str, object]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)
    return path


def problems_file(path: Path, prompts: Sequence[Sequence[str]], answers: Sequence[int]
                  ) -> Path:
    return write_jsonl(path, [{"question": " ".join(p), "answer": a}
                              for p, a in zip(prompts, answers, strict=True)])


def docs_file(path: Path, docs: Sequence[Sequence[str]]) -> Path:
    return write_jsonl(path, [{"text": " ".join(d)} for d in docs])


def accuracy_set(name: str, language: str, path: Path) -> EvalSetSpec:
    return EvalSetSpec(name=name, language=LANG_CODE[language], kind="accuracy",
                       path=str(path), template="{question}", max_new_tokens=2,
                       batch_size=BATCH)


def perplexity_set(name: str, language: str, path: Path) -> EvalSetSpec:
    return EvalSetSpec(name=name, language=LANG_CODE[language], kind="perplexity",
                       path=str(path), context=CONTEXT, stride=CONTEXT, batch_size=BATCH)


def spec(*sets: EvalSetSpec) -> EvalSpec:
    return EvalSpec(sets=list(sets))
