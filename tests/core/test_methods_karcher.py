"""Karcher mean: closed forms, and agreement with mergekit 0.1.5."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from maec_core.methods.karcher import karcher_mean
from maec_core.parsing import parse_recipe
from tests.core.test_methods import call, close


def test_karcher_symmetric_directions() -> None:
    # Two orthogonal directions: the geodesic midpoint; the norm is the mean norm 1.5.
    r = 1.5 / math.sqrt(2)
    close(call("karcher", None, [[2.0, 0.0], [0.0, 1.0]]), [r, r])
    # e1, e2, e3: the diagonal.
    s = 1 / math.sqrt(3)
    close(call("karcher", None, [[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0]]), [s, s, s])
    # The base is one more input: e1, e2 and their bisector average to the bisector,
    # with the mean norm (1 + 1 + √2) / 3.
    n = (2 + math.sqrt(2)) / 3
    close(call("karcher", [1.0, 0.0, 0.0], [[0.0, 1.0, 0.0], [1.0, 1.0, 0.0]]),
          [n / math.sqrt(2), n / math.sqrt(2), 0.0])


def test_karcher_is_the_spherical_not_the_euclidean_mean() -> None:
    # Directions at 0°, 0° and 90°: the Karcher mean lies at 30° (the mean angle), the
    # normalised Euclidean mean at atan(1/2) ≈ 26.6°.
    got = call("karcher", None, [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], max_iter=50, tol=1e-9)
    close(got, [math.cos(math.pi / 6), math.sin(math.pi / 6)])
    start = call("karcher", None, [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], max_iter=0)
    close(start, [2 / math.sqrt(5), 1 / math.sqrt(5)])


def test_karcher_zero_and_single_inputs() -> None:
    # A zero input has no direction but counts in the mean norm: (0 + 3) / 2.
    close(call("karcher", None, [[0.0, 0.0], [3.0, 0.0]]), [1.5, 0.0])
    close(call("karcher", None, [[0.0, 0.0], [0.0, 0.0]]), [0.0, 0.0])
    close(call("karcher", None, [[2.0, -1.0]]), [2.0, -1.0])


def test_karcher_mean_converges_within_tolerance() -> None:
    gen = torch.Generator().manual_seed(0)
    units = [u / u.norm() for u in torch.randn(4, 50, generator=gen).double()]
    mean = karcher_mean(units, [0.25] * 4, max_iter=100, tol=1e-12)
    # At the Karcher mean the log maps of the points sum to zero.
    logs = []
    for u in units:
        dot = float(torch.clamp(mean @ u, -1.0, 1.0))
        theta = math.acos(dot)
        logs.append(theta / math.sin(theta) * (u - dot * mean))
    assert float(torch.stack(logs).sum(0).norm()) < 1e-9
    assert abs(float(mean.norm()) - 1) < 1e-12


def test_karcher_recipe() -> None:
    parse_recipe({"merge_method": "karcher", "models": [{"model": "a"}, {"model": "c"}],
                  "parameters": {"max_iter": 20, "tol": 1e-6}})


mergekit = pytest.importorskip("mergekit.merge")


@pytest.mark.slow
@pytest.mark.parametrize("with_base", [True, False])
def test_karcher_agrees_with_mergekit(zoo: dict[str, Path], tmp_path: Path,
                                      with_base: bool) -> None:
    from tests.core.test_methods_mergekit import compare_with_mergekit

    recipe: dict[str, Any] = {
        "merge_method": "karcher",
        "models": [{"model": str(zoo["a"])}, {"model": str(zoo["b"])}],
        "parameters": {"max_iter": [{"filter": "mlp", "value": 3}, {"value": 10}]},
        "dtype": "float32",
    }
    if with_base:
        recipe["base_model"] = str(zoo["base"])
    compare_with_mergekit(recipe, tmp_path)
