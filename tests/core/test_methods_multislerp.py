"""Multi-SLERP: closed forms, and agreement with mergekit 0.1.5."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from maec_core.errors import MaecError, RecipeError
from maec_core.parsing import parse_recipe
from tests.core.test_methods import call, close


def test_multislerp_takes_the_mean_direction_and_the_mean_norm() -> None:
    # Directions (1, 0) and (0, 1), norms 2 and 1, equal weights: the direction half-way,
    # norm 1.5.
    r = 1.5 / math.sqrt(2)
    close(call("multislerp", None, [[2.0, 0.0], [0.0, 1.0]]), [r, r])
    # Weights 1 and 3 (normalised to 1/4, 3/4): direction ∝ (1/4, 3/4), norm 1/2 + 3/4.
    d = torch.tensor([0.25, 0.75])
    want = (d / d.norm() * 1.25).tolist()
    close(call("multislerp", None, [[2.0, 0.0], [0.0, 1.0]], [{"weight": 1}, {"weight": 3}]),
          want)
    # Without normalize_weights the norm is the plain weighted sum (2 + 3 = 5).
    close(call("multislerp", None, [[2.0, 0.0], [0.0, 1.0]], [{"weight": 1}, {"weight": 3}],
               normalize_weights=False), (d / d.norm() * 5).tolist())


def test_multislerp_around_a_base() -> None:
    base = [1.0, 1.0, 1.0]
    # Task vectors e1, e2, e3 (unit norm each): (1, 1, 1)/√3 added to the base.
    models = [[2.0, 1.0, 1.0], [1.0, 2.0, 1.0], [1.0, 1.0, 2.0]]
    s = 1 / math.sqrt(3)
    close(call("multislerp", base, models), [1 + s, 1 + s, 1 + s])
    # One model: returned as it is.
    close(call("multislerp", base, models[:1]), models[0])


def test_multislerp_opposite_inputs() -> None:
    # Two opposite directions with equal weights: the weighted sum (mergekit's fallback).
    close(call("multislerp", None, [[2.0, 0.0], [-1.0, 0.0]]), [0.5, 0.0])
    # Three inputs whose directions cancel have no mean direction.
    with pytest.raises(MaecError, match=r"weighted mean .* is zero"):
        call("multislerp", None, [[1.0, 0.0], [-1.0, 0.0], [2.0, 0.0]],
             [{"weight": 1}, {"weight": 2}, {"weight": 1}])
    with pytest.raises(MaecError, match="sum to zero"):
        call("multislerp", None, [[1.0, 0.0], [0.0, 1.0]], [{"weight": 1}, {"weight": -1}])


def test_multislerp_recipe() -> None:
    parse_recipe({"merge_method": "multislerp",
                  "models": [{"model": "a", "parameters": {"weight": 0.3}}],
                  "parameters": {"normalize_weights": False, "eps": 1e-6}})
    with pytest.raises(RecipeError, match="eps"):
        parse_recipe({"merge_method": "multislerp", "models": [{"model": "a"}],
                      "parameters": {"eps": -1}})


mergekit = pytest.importorskip("mergekit.merge")


@pytest.mark.slow
@pytest.mark.parametrize("with_base", [True, False])
@pytest.mark.parametrize("params", [{}, {"normalize_weights": False}])
def test_multislerp_agrees_with_mergekit(zoo: dict[str, Path], tmp_path: Path,
                                         with_base: bool, params: dict[str, Any]) -> None:
    from tests.core.test_methods_mergekit import compare_with_mergekit, two_weighted

    compare_with_mergekit(two_weighted(zoo, "multislerp", params, with_base=with_base), tmp_path)
