"""Conformance run: our own copies of mergekit-style recipes through both tools.

Every recipe under tests/conformance/recipes runs through our engine and through
mergekit 0.1.5 (its Python API, in-process, CPU) on tiny locally built checkpoints, and
the outputs are compared tensor by tensor (see tests/conformance/suite.py for the
tolerances). Prints one line per recipe, then exactly one line:

RESULT conformance methods=<registered methods> recipes_passed=<n>/<t> max_abs_diff=<worst>

where max_abs_diff is the largest |ours - mergekit| over every tensor of every recipe
(known differences included).

    .venv/bin/python -m bench.conformance
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from maec_core.methods import all_methods
from tests.conformance.suite import KNOWN_DIFFERENCES, build_models, recipe_files, run_one


def main() -> None:
    logging.disable(logging.WARNING)  # mergekit and transformers chatter on stderr
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="maec-conformance-") as tmp:
        root = Path(tmp)
        models = build_models(root / "models")
        for path in recipe_files():
            outcome = run_one(path, models, root)
            outcomes.append(outcome)
            state = "ok" if outcome.passed else "DIFFERS"
            print(f"{outcome.recipe:<26} {state:<8} tensors={outcome.tensors:<4} "
                  f"max_abs_diff={outcome.max_abs_diff:.3g}")
            for problem in outcome.problems[:3]:
                print(f"    {problem}")
            if not outcome.passed and outcome.recipe in KNOWN_DIFFERENCES:
                print(f"    known: {KNOWN_DIFFERENCES[outcome.recipe]}")
    passed = sum(o.passed for o in outcomes)
    worst = max((o.max_abs_diff for o in outcomes), default=0.0)
    print(f"RESULT conformance methods={len(all_methods())} "
          f"recipes_passed={passed}/{len(outcomes)} max_abs_diff={worst:.3g}")


if __name__ == "__main__":
    main()
