"""Smoke run of the transfer experiment: one seed, small budget, end to end.

Asserts only what is stably true at this scale, plus the harness's sanity checks: the donor
answers the positive-control language T′ (S relexified) zero-shot at least 3x chance, the
second donor learned its own skill, and the constrained selection chose what the
constraint allows. The transfer numbers themselves are reported (the RESULT line), not
asserted: at this budget they say nothing about which method is better.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from tests import smoke_experiment

RESULT = re.compile(
    r"^RESULT transfer maec_target_acc=(?P<maec>[0-9.]+) langbase_target_acc=(?P<lang>[0-9.]+) "
    r"ta_target_acc=(?P<ta>[0-9.]+) layerswap_target_acc=(?P<ls>[0-9.]+) "
    r"control_donor_target_acc=(?P<cdonor>[0-9.]+) control_maec_target_acc=(?P<cmaec>[0-9.]+) "
    r"control_langbase_target_acc=(?P<clang>[0-9.]+) "
    r"multi_maec_min_acc=(?P<multi_maec>[0-9.]+) multi_ta_min_acc=(?P<multi_ta>[0-9.]+) "
    r"multi_ties_min_acc=(?P<multi_ties>[0-9.]+) "
    r"constrained_maec_acc=(?P<con_maec>[0-9.]+|nan) "
    r"constrained_best_baseline_acc=(?P<con_base>[0-9.]+|nan) "
    r"extvocab_maec_acc=(?P<x_maec>[0-9.]+) extvocab_ta_acc=(?P<x_ta>[0-9.]+)$", re.M)
BASELINES = ("task_arithmetic", "ties", "dare_ties", "layer_swap")


def _approx(field: str, value: float | None) -> None:
    """A RESULT field against the results file: 'nan' exactly when there is no value."""
    if value is None:
        assert field == "nan"
    else:
        assert float(field) == pytest.approx(value, abs=1e-3)


@pytest.mark.experiment
@pytest.mark.timeout(1800)
def test_transfer_smoke() -> None:
    # Started by conftest when the session began (see tests/smoke_experiment.py), or here.
    run = smoke_experiment.started or smoke_experiment.SmokeRun()
    try:
        _check(run.wait(timeout=1750), run.out)
    finally:
        if run is not smoke_experiment.started:
            run.stop()


def _check(proc: smoke_experiment.Finished, out: Path) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    match = RESULT.search(proc.stdout)
    assert match, proc.stdout[-3000:]
    # The RESULT line is the test's report; print it whether or not pytest captures.
    print(match.group(0))

    res = json.loads((out / "results.json").read_text())
    targets = res["seeds"][0]["targets"]
    uniform, _majority = res["chance"]
    test = {k: v["test"] for k, v in targets["T"]["methods"].items()}
    control = {k: v["test"] for k, v in targets["R"]["methods"].items()}
    # Every compared model and method produced a model the evaluation could read, on both
    # target languages.
    for name in ("theta0", "thetaL", "thetaA", "thetaS", "task_arithmetic", "ties",
                 "dare_ties", "layer_swap", "maec_delta"):
        for table in (test, control):
            assert name in table, name
            assert 0.0 <= table[name]["target_acc"] <= 1.0
    # The donor learned the ability in S, far above chance; the language base has none.
    assert test["thetaA"]["S_acc"] >= test["thetaL"]["S_acc"] + 0.2
    assert test["thetaA"]["S_acc"] >= 3 * uniform
    # The harness's sanity check: on T′, S relexified over a base whose T′ words start as
    # copies of their S counterparts, an S-trained donor must answer zero-shot well above
    # chance. If it does not, nothing measured on T can tell a method apart.
    assert control["thetaA"]["target_acc"] >= 3 * uniform, control["thetaA"]
    # Training on a language's text makes it more predictable than the base found it.
    assert test["thetaL"]["target_ppl"] < test["theta0"]["target_ppl"]
    assert control["thetaL"]["target_ppl"] < control["theta0"]["target_ppl"]
    # The RESULT line reports the numbers of the results file, not something else.
    assert float(match["lang"]) == pytest.approx(test["thetaL"]["target_acc"], abs=1e-3)
    assert float(match["ta"]) == pytest.approx(test["task_arithmetic"]["target_acc"], abs=1e-3)
    assert float(match["cdonor"]) == pytest.approx(control["thetaA"]["target_acc"], abs=1e-3)
    assert float(match["clang"]) == pytest.approx(control["thetaL"]["target_acc"], abs=1e-3)
    assert float(match["cmaec"]) == pytest.approx(control["maec_delta"]["target_acc"],
                                                  abs=1e-3)

    methods = {t: targets[t]["methods"] for t in ("T", "R", "X")}
    # The second donor learned its own skill (the larger of two counts) in S, well above
    # the 0.5 of answering one of the two counts shown, and far above the language base.
    b = methods["T"]["thetaB"]["test"]
    assert b["S_acc_b"] >= 0.7, b
    assert b["S_acc_b"] >= methods["T"]["thetaL"]["test"]["S_acc_b"] + 0.2
    assert res["chance_b"][1] == 0.5
    # Every merge of the added comparisons produced a model the evaluation could read:
    # ability B alone and both abilities, into T and T′; the extended-vocabulary target's
    # checkpoints and merges.
    for t in ("T", "R"):
        for m in ("task_arithmetic", "ties", "dare_ties", "maec_delta"):
            for name, sets in ((f"{m}_b", ("target_acc_b", "S_acc_b")),
                               (f"{m}_multi", ("target_acc", "target_acc_b", "S_acc",
                                               "S_acc_b"))):
                assert name in methods[t], (t, name)
                for k in sets:
                    assert 0.0 <= methods[t][name]["test"][k] <= 1.0, (t, name, k)
                assert math.isfinite(methods[t][name]["test"]["target_ppl"]), (t, name)
    for name in ("theta0", "thetaL", "thetaA", "task_arithmetic", "ties", "maec_delta"):
        assert 0.0 <= methods["X"][name]["test"]["target_acc"] <= 1.0, name
        assert math.isfinite(methods["X"][name]["test"]["target_ppl"]), name
    # The extended language base reads T′x (its new tokens were trained); θ0, whose
    # tokenizer lacks every T′x word, cannot.
    assert methods["X"]["thetaL"]["test"]["target_ppl"] < methods["X"]["theta0"]["test"][
        "target_ppl"]

    # Selection: the unconstrained winner has the best validation objective of all
    # candidates, the constrained one the best of those within the bound, and the bound
    # is 1.5 x the language base's validation perplexity.
    for t, table in methods.items():
        lang_ppl = table["thetaL"]["val"]["target_ppl"]
        for name, r in table.items():
            if r["family"] == "single":
                continue
            objective = {"A": "target_acc", "B": "target_acc_b",
                         "AB": "target_acc_ab"}[r["family"]]
            assert r["bound"] == pytest.approx(res["ppl_ratio"] * lang_ppl, rel=1e-4), (t, name)
            best = max(row["val"][objective] for row in r["sweep"])
            assert r["val"][objective] == best, (t, name)
            feasible = [row for row in r["sweep"] if row["val"]["target_ppl"] <= r["bound"]]
            assert [row["feasible"] for row in r["sweep"]] == [
                row in feasible for row in r["sweep"]], (t, name)
            if r["constrained"] is None:
                assert not feasible, (t, name)
            else:
                assert r["constrained"]["val"]["target_ppl"] <= r["bound"], (t, name)
                assert r["constrained"]["val"][objective] == max(
                    row["val"][objective] for row in feasible), (t, name)

    # The new RESULT fields are the results file's numbers.
    def min_acc(name: str) -> float:
        scores = methods["R"][name]["test"]
        return float(min(scores["target_acc"], scores["target_acc_b"]))

    _approx(match["multi_maec"], min_acc("maec_delta_multi"))
    _approx(match["multi_ta"], min_acc("task_arithmetic_multi"))
    _approx(match["multi_ties"], min_acc("ties_multi"))
    held = methods["R"]["maec_delta"]["constrained"]
    _approx(match["con_maec"], held["test"]["target_acc"] if held else None)
    feasible_baselines = [(methods["R"][m]["constrained"]["val"]["target_acc"], -i, m)
                          for i, m in enumerate(BASELINES)
                          if methods["R"][m]["constrained"] is not None]
    chosen = max(feasible_baselines)[2] if feasible_baselines else None
    _approx(match["con_base"], methods["R"][chosen]["constrained"]["test"]["target_acc"]
            if chosen else None)
    _approx(match["x_maec"], methods["X"]["maec_delta"]["test"]["target_acc"])
    _approx(match["x_ta"], methods["X"]["task_arithmetic"]["test"]["target_acc"])
    assert res["result_fields"]["extvocab_ta_acc"] == pytest.approx(
        methods["X"]["task_arithmetic"]["test"]["target_acc"])
