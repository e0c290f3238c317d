"""Model Breadcrumbs and Breadcrumbs-TIES: closed forms, and agreement with mergekit 0.1.5."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.core.test_methods import call, close, lam


def test_breadcrumbs_drops_outliers_then_small_entries() -> None:
    base = [0.0] * 10
    a = [10.0, -9.0, 1.0, 2.0, -3.0, 4.0, 5.0, -6.0, 7.0, 0.5]
    # n = 10: density 0.5 keeps 5, gamma 0.2 drops the 2 largest (10, -9), so the
    # survivors are the 3rd to 7th largest magnitudes: -6, 7, 5, 4, -3.
    got = call("breadcrumbs", base, [a], [{"density": 0.5, "gamma": 0.2}])
    close(got, [0, 0, 0, 0, -3.0, 4.0, 5.0, -6.0, 7.0, 0])
    # Outlier removal shrinks when it would leave fewer than density·n: 9 kept, so only
    # the largest goes (gamma alone would take two) and none at the bottom.
    got = call("breadcrumbs", base, [a], [{"density": 0.9, "gamma": 0.2}])
    close(got, [0, -9.0, 1.0, 2.0, -3.0, 4.0, 5.0, -6.0, 7.0, 0.5])
    # density·n below one keeps nothing (mergekit's count, unlike TIES's at-least-one).
    close(call("breadcrumbs", base, [a], [{"density": 0.05}]), [0.0] * 10)


def test_breadcrumbs_weights_normalize_lambda_rescale() -> None:
    base = [1.0, 1.0, 1.0, 1.0]
    a = [2.0, 1.0, 5.0, 1.5]  # delta (1, 0, 4, 0.5)
    b = [0.0, 3.0, 1.0, 1.0]  # delta (-1, 2, 0, 0)
    mp = [{"weight": 0.5, "density": 1.0}, {"weight": 2.0, "density": 1.0}]
    # Density 1 is task arithmetic: base + λ Σ w_i τ_i.
    close(call("breadcrumbs", base, [a, b], mp, **lam(2.0)),
          [1.0 + 2 * (0.5 - 2.0), 1.0 + 2 * 4.0, 1.0 + 2 * 2.0, 1.0 + 2 * 0.25])
    close(call("breadcrumbs", base, [a, b], mp, normalize=True),
          [1.0 - 1.5 / 2.5, 1.0 + 4 / 2.5, 1.0 + 2 / 2.5, 1.0 + 0.25 / 2.5])
    # n = 4, keep 2, one outlier (4) and one small entry (0) go: delta (1, 0, 0, 0.5);
    # rescale scales it back to the L1 norm 5.5 it had before trimming.
    one = [{"density": 0.5, "gamma": 0.25}]
    close(call("breadcrumbs", base, [a], one), [2.0, 1.0, 1.0, 1.5])
    close(call("breadcrumbs", base, [a], one, rescale=True),
          [1.0 + 5.5 / 1.5, 1.0, 1.0, 1.0 + 0.5 * 5.5 / 1.5])


def test_breadcrumbs_ties_elects_signs() -> None:
    base = [0.0, 0.0, 0.0]
    a = [3.0, -1.0, 2.0]
    b = [-1.0, -2.0, 2.0]
    # Density 1: TIES election without trimming; normalize is off by default, so the
    # agreeing deltas are summed: entry 0 (+2 elected): 3; entry 1: -3; entry 2: 4.
    close(call("breadcrumbs_ties", base, [a, b]), [3.0, -3.0, 4.0])
    close(call("breadcrumbs_ties", base, [a, b], normalize=True), [3.0, -1.5, 2.0])


mergekit = pytest.importorskip("mergekit.merge")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["breadcrumbs", "breadcrumbs_ties"])
@pytest.mark.parametrize(("donor", "params"), [
    ({"density": 0.6, "gamma": 0.05}, {}),
    ({"density": [{"filter": "mlp", "value": 0.3}, {"value": 0.8}], "gamma": 0.1},
     {"normalize": True, "lambda": 0.7}),
    ({"density": 0.5}, {"rescale": True}),
])
def test_agrees_with_mergekit(zoo: dict[str, Path], tmp_path: Path, method: str,
                              donor: dict[str, object], params: dict[str, object]) -> None:
    from tests.core.test_methods_mergekit import compare_with_mergekit, two_donors

    compare_with_mergekit(two_donors(zoo, method, donor, **params), tmp_path)


def test_trim_outliers_is_a_threshold_on_magnitudes() -> None:
    from maec_core.methods._sparsify import trim_outliers_

    gen = torch.Generator().manual_seed(0)
    delta = torch.randn(1000, generator=gen)
    kept = trim_outliers_(delta.clone(), 0.3, 0.05) != 0
    ranks = delta.abs().argsort().argsort()  # 0 = smallest magnitude
    # 50 outliers go at the top, 650 small entries at the bottom: ranks 650..949 stay.
    assert torch.equal(kept, (ranks >= 650) & (ranks < 950))
