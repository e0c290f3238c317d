"""Smoke run of the transfer experiment: one seed, small budget, end to end.

Asserts only what is stably true at this scale, plus the harness's sanity check: the donor
answers the positive-control language T′ (S relexified) zero-shot at least 3x chance. The
transfer numbers on T themselves are reported (the RESULT line), not asserted, because at
this budget they sit near chance.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULT = re.compile(
    r"^RESULT transfer maec_target_acc=(?P<maec>[0-9.]+) langbase_target_acc=(?P<lang>[0-9.]+) "
    r"ta_target_acc=(?P<ta>[0-9.]+) layerswap_target_acc=(?P<ls>[0-9.]+) "
    r"control_donor_target_acc=(?P<cdonor>[0-9.]+) control_maec_target_acc=(?P<cmaec>[0-9.]+) "
    r"control_langbase_target_acc=(?P<clang>[0-9.]+)$", re.M)


@pytest.mark.experiment
@pytest.mark.timeout(1200)
def test_transfer_smoke(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.transfer.run", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1150, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    match = RESULT.search(proc.stdout)
    assert match, proc.stdout[-3000:]
    # The RESULT line is the test's report; print it whether or not pytest captures.
    print(match.group(0))

    res = json.loads((tmp_path / "results.json").read_text())
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
