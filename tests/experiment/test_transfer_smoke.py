"""Smoke run of the transfer experiment: one seed, small budget, end to end.

Asserts only what is stably true at this scale; the transfer numbers themselves are
reported (the RESULT line), not asserted, because at this budget they sit near chance.
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
    r"ta_target_acc=(?P<ta>[0-9.]+) layerswap_target_acc=(?P<ls>[0-9.]+)$", re.M)


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
    seed = res["seeds"][0]
    methods = seed["methods"]
    uniform, _majority = res["chance"]
    test = {k: v["test"] for k, v in methods.items()}
    # Every compared model and method produced a model the evaluation could read.
    for name in ("theta0", "thetaL", "thetaA", "thetaS", "task_arithmetic", "ties",
                 "dare_ties", "layer_swap", "maec_delta"):
        assert name in test, name
        assert 0.0 <= test[name]["T_acc"] <= 1.0
    # The donor learned the ability in S, far above chance; the language base has none.
    assert test["thetaA"]["S_acc"] >= test["thetaL"]["S_acc"] + 0.2
    assert test["thetaA"]["S_acc"] >= 3 * uniform
    # Training on T text makes T more predictable than the base found it.
    assert test["thetaL"]["T_ppl"] < test["theta0"]["T_ppl"]
    # The RESULT line reports the numbers of the results file, not something else.
    assert float(match["lang"]) == pytest.approx(test["thetaL"]["T_acc"], abs=1e-3)
    assert float(match["ta"]) == pytest.approx(test["task_arithmetic"]["T_acc"], abs=1e-3)
