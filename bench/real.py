"""Benchmark: what each merge method does to a real model's quality.

Every registered method merges the real family (tests/real_model.py: SmolLM2-135M-Instruct,
real weights and tokenizer, with synthetic low-rank "fine-tunes" ``donor`` and ``lang``)
with the recipe the real-weights tests use (tests/real/test_methods.py; the sparsifying
methods at density 0.5, Breadcrumbs at 0.9 without the top 1%), then the output
is evaluated as an evaluated job evaluates it (:func:`maec_core.eval.runner.evaluate`):
perplexity on two short texts written for this benchmark (bench/data/real_eval.yaml:
English and French), and greedy answers to a few chat prompts. The inputs are scored the
same way first, for reference. A report, not a timed test.

    .venv/bin/python -m bench.real [--methods linear,ties] [--markdown]

Ends with one line: RESULT real methods=<n> max_ppl_en_ratio=<worst merged/base>
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from maec_core.eval.runner import evaluate
from maec_core.eval.sets import load_spec
from tests import real_model
from tests.factories import run_recipe
from tests.real.test_methods import _methods, recipe

SPEC = Path(__file__).parent / "data" / "real_eval.yaml"
PROMPTS = ["What is the capital of France?",
           "How many legs does a spider have?",
           "Translate to French: good morning"]


def score(folder: Path) -> tuple[dict[str, float], list[str]]:
    report = evaluate(folder, load_spec(SPEC))
    ppl = {s.name: s.value for s in report.models[0].sets}
    model, tok = real_model.load(folder)
    answers = [real_model.answer(model, tok, p, max_new_tokens=20) for p in PROMPTS]
    return ppl, answers


def _cell(text: str, width: int = 48) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= width else text[:width - 1] + "…"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", help="comma-separated; every registered method by default")
    args = ap.parse_args()
    reason = real_model.available()
    if reason:
        raise SystemExit(reason)
    family = real_model.real_family()
    methods = args.methods.split(",") if args.methods else _methods()
    rows: list[tuple[str, dict[str, float], list[str], float]] = []
    for name in ("base", "donor", "lang"):
        ppl, answers = score(family[name])
        rows.append((f"input: {name}", ppl, answers, 0.0))
        print(f"{name}: {ppl} {answers}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-real-"))
    try:
        for method in methods:
            out = work / method
            t0 = time.perf_counter()
            run_recipe(recipe(method, family, sparse=True), out, device="cpu")
            merge_s = time.perf_counter() - t0
            ppl, answers = score(out)
            rows.append((method, ppl, answers, merge_s))
            print(f"{method}: merge {merge_s:.1f}s {ppl} {answers}", flush=True)
            shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sets = list(rows[0][1])
    print()
    print("| model | " + " | ".join(f"ppl {s}" for s in sets) + " | merge s | "
          + " | ".join(f"“{_cell(p, 40)}”" for p in PROMPTS) + " |")
    print("|---" * (len(sets) + 2 + len(PROMPTS)) + "|")
    for label, ppl, answers, merge_s in rows:
        merge = f"{merge_s:.1f}" if merge_s else "–"
        print(f"| {label} | " + " | ".join(f"{ppl[s]:.2f}" for s in sets) + f" | {merge} | "
              + " | ".join(_cell(a) for a in answers) + " |")
    base_en = rows[0][1][sets[0]]
    worst = max(r[1][sets[0]] / base_en for r in rows[3:]) if len(rows) > 3 else 1.0
    print(f"\nRESULT real methods={len(rows) - 3} max_ppl_en_ratio={worst:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
