"""Conformance run: mergekit's own recipes through both tools.

Every recipe under tests/conformance/recipes (transcribed from mergekit's examples/ and
the configurations its test suite builds) runs through our engine and through mergekit
0.1.5 (its Python API, in-process, CPU) on tiny locally built checkpoints of every
architecture the recipes name; see tests/conformance/suite.py for what is compared.
Prints one line per recipe, a line of the other comparisons, then exactly one line:

RESULT conformance methods=<methods mergekit registers that we register too>
  recipes_total=<n> accepted_both=<n> tensor_equal=<n> refused_only_ours=<n>
  refused_only_mergekit=<n> moe_configs=<n> moe_equal=<n> max_abs_diff=<worst>

(on one line). tensor_equal counts recipes both accept whose tensors agree (by
statistics for random masks); max_abs_diff is the largest |ours - mergekit| over every
element-wise compared tensor. The moe fields count mergekit-moe configs: see
``moe_results``.

    .venv/bin/python -m bench.conformance [-k SUBSTRING]
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # before tqdm is imported: no progress bars

from maec_core.methods import all_methods
from tests.conformance.models import ModelFarm
from tests.conformance.moe_suite import moe_result_fields
from tests.conformance.suite import (
    KNOWN_DIFFERENCES,
    Outcome,
    recipe_files,
    run_one,
)


def moe_results(root: Path) -> tuple[int, int]:
    """(mergekit-moe configs run, configs whose output equals mergekit-moe's): every
    case of tests/conformance/moe_suite.py through mergekit-moe 0.1.5 and ours, under
    ``root``."""
    fields = moe_result_fields(root / "moe")
    return fields["moe_configs"], fields["moe_equal"]


def _line(o: Outcome) -> str:
    if not o.agree:
        state = "REFUSED-OURS" if o.theirs.accepted else "REFUSED-MK"
    elif not o.ours.accepted:
        state = "refused-both"
    elif o.passed:
        state = "ok-stats" if o.statistical else "ok"
    else:
        state = "DIFFERS"
    return (f"{o.recipe:<34} {o.method:<16} {state:<13} tensors={o.tensors:<4} "
            f"max_abs_diff={o.max_abs_diff:.3g}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-k", default="", help="only recipes whose name has this")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # mergekit and transformers chatter on stderr
    warnings.simplefilter("ignore")
    ours_methods = {m.name for m in all_methods()}
    from mergekit.merge_methods.registry import registered_methods

    theirs_methods = {m.spec.name for m in registered_methods()}
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="maec-conformance-") as tmp:
        root = Path(tmp)
        farm = ModelFarm(root / "models")
        for path in recipe_files():
            if args.k not in path.stem:
                continue
            o = run_one(path, farm, root / "out")
            outcomes.append(o)
            print(_line(o), flush=True)
            for reason in ((f"ours: {o.ours.reason}",) if not o.ours.accepted else ()):
                print(f"    {reason}")
            if not o.theirs.accepted:
                print(f"    mergekit: {o.theirs.reason}")
            for problem in (o.problems[:3] + o.other[:3]):
                print(f"    {problem}")
            if not o.passed and o.recipe in KNOWN_DIFFERENCES:
                print(f"    known: {KNOWN_DIFFERENCES[o.recipe]}")
        moe_configs, moe_equal = moe_results(root)
    both = [o for o in outcomes if o.ours.accepted and o.theirs.accepted]
    worst = max((o.max_abs_diff for o in both), default=0.0)
    only_ours = sum(o.theirs.accepted and not o.ours.accepted for o in outcomes)
    only_theirs = sum(o.ours.accepted and not o.theirs.accepted for o in outcomes)
    exact = [o for o in both if o.tensor_equal and not o.statistical]
    print(f"equal tensors: bit_equal={sum(o.max_abs_diff == 0 for o in exact)} "
          f"within_rounding={sum(o.max_abs_diff > 0 for o in exact)} "
          f"by_statistics={sum(o.tensor_equal and o.statistical for o in both)}")
    print(f"other files: accepted_both={len(both)} "
          f"config_tokenizer_load_equal={sum(not o.other for o in both)}")
    print(f"RESULT conformance methods={len(ours_methods & theirs_methods)} "
          f"recipes_total={len(outcomes)} accepted_both={len(both)} "
          f"tensor_equal={sum(o.tensor_equal for o in both)} "
          f"refused_only_ours={only_ours} refused_only_mergekit={only_theirs} "
          f"moe_configs={moe_configs} moe_equal={moe_equal} max_abs_diff={worst:.3g}")


if __name__ == "__main__":
    main()
