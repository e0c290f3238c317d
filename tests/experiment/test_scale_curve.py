"""The two-size key_ratio curve's choices and its RESULT line (the curve itself runs in
``make experiment``: tens of minutes, not part of the suite)."""

from __future__ import annotations

import re

from experiments.transfer.scale import (
    KEY_RATIOS,
    SIZES,
    best_per_key_ratio,
    config,
    result_line,
)


def _row(cid: str, key_ratio: float, mu: float, acc: float) -> dict[str, object]:
    return {"id": cid, "knobs": {"key_ratio": key_ratio, "mu": mu},
            "val": {"target_acc": acc, "target_ppl": 5.0}, "feasible": True}


def test_each_key_ratio_gets_its_best_mu_on_validation_first_on_ties() -> None:
    rows = [_row("a", 0.05, 1.0, 0.10), _row("b", 0.05, 2.0, 0.20),
            _row("c", 1.0, 1.0, 0.30), _row("d", 1.0, 2.0, 0.30), _row("e", 0.2, 1.0, 0.0)]
    assert best_per_key_ratio(rows) == {0.05: "b", 0.2: "e", 1.0: "c"}


def test_the_large_size_is_about_four_times_the_small_one() -> None:
    from experiments.transfer import model as M

    small, large = (M.new_model(config(s).size, 0) for s in ("small", "large"))
    n = [sum(p.numel() for p in m.parameters()) for m in (small, large)]
    assert 3.5 < n[1] / n[0] < 4.5
    # Same budgets and data, another size: only the size (and the eval-set folder) differ.
    small, large, ft2x = (config(s) for s in ("small", "large", "large-ft2x"))
    assert (large.base, large.ability, large.n_train) == (small.base, small.ability,
                                                          small.n_train)
    # The third size shares the 4x θ0 and trains its fine-tunes for twice the steps.
    assert ft2x.size == large.size and ft2x.base == large.base
    assert ft2x.stage_key("theta0", 0) == large.stage_key("theta0", 0)
    assert (ft2x.ability.steps, ft2x.language.steps) == (2 * small.ability.steps,
                                                         2 * small.language.steps)


def test_result_line_has_every_size_and_key_ratio() -> None:
    def size(params: int) -> dict[str, object]:
        return {"params": params, "singles": {"thetaA": {"target_acc": 0.25}},
                "curve": [{"key_ratio": k, "test": {"target_acc": 0.1}} for k in KEY_RATIOS]}

    assert SIZES == ("small", "large-ft2x")
    line = result_line({"small": size(1), "large-ft2x": size(4)})
    assert line.startswith("RESULT scale small_params=1 small_donor_acc=0.250 ")
    for s in ("small", "large_ft2x"):
        for k in KEY_RATIOS:
            assert re.search(rf"\b{s}_kr{k}_acc=0\.100\b", line)
