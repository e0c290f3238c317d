"""Arcee Fusion: closed forms, and agreement with mergekit 0.1.5."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from maec_core.errors import RecipeError
from maec_core.methods.arcee_fusion import importance, upper_fence
from maec_core.parsing import parse_recipe, recipe_warnings
from tests.core.test_methods import call, close


def test_arcee_fusion_takes_only_the_outlying_changes() -> None:
    # One row: the KL factor is shared, so importances rank as |diff| = 1..7, 20. The
    # order statistics at ⌊q · 7⌋ (q = 1/4, 1/2, 3/4) are 2, 4, 6: fence 4 + 1.5 · 4 = 10.
    base = [0.0] * 8
    other = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 20.0]
    close(call("arcee_fusion", base, [other]), [0.0] * 7 + [20.0])
    # A change of 10 sits exactly on the fence and is taken.
    other = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 10.0]
    close(call("arcee_fusion", [0.0] * 8, [other]), [0.0] * 7 + [10.0])


def test_arcee_fusion_importance_needs_a_changed_distribution() -> None:
    base = torch.zeros(2, 4)
    # Row 0 shifts every entry by 3: its softmax, hence its KL factor, is unchanged.
    other = torch.tensor([[3.0, 3.0, 3.0, 3.0], [0.0, 0.0, 0.0, 3.0]])
    scores = importance(other, base)
    close(scores[0], [0.0] * 4)
    p = torch.softmax(other[1], 0) + 1e-8
    q = torch.softmax(base[1], 0) + 1e-8
    kl = float((p * (p / q).log()).sum())
    close(scores[1], [0.0, 0.0, 0.0, 3.0 * kl])
    # Fence from exact order statistics: 9 values, indices 2, 4, 6.
    fence = upper_fence(torch.tensor([9.0, 1.0, 8.0, 2.0, 7.0, 3.0, 6.0, 4.0, 5.0]))
    assert float(fence) == 5.0 + 1.5 * (7.0 - 3.0)


def test_arcee_fusion_takes_one_model_and_no_parameters() -> None:
    with pytest.raises(RecipeError, match="exactly 1"):
        parse_recipe({"merge_method": "arcee_fusion", "base_model": "b",
                      "models": [{"model": "a"}, {"model": "c"}]})
    with pytest.raises(RecipeError, match="needs base_model"):
        parse_recipe({"merge_method": "arcee_fusion", "models": [{"model": "a"}]})
    # A weight is accepted and reported, not read (mergekit ignores it too).
    recipe = parse_recipe({"merge_method": "arcee_fusion", "base_model": "b",
                           "models": [{"model": "a", "parameters": {"weight": 1}}]})
    assert recipe_warnings(recipe) == [
        "models[0].parameters.weight ignored: merge_method 'arcee_fusion' does not read it"]


mergekit = pytest.importorskip("mergekit.merge")


@pytest.mark.slow
def test_arcee_fusion_agrees_with_mergekit(zoo: dict[str, Path], tmp_path: Path) -> None:
    from tests.core.test_methods_mergekit import compare_with_mergekit

    recipe: dict[str, Any] = {
        "merge_method": "arcee_fusion",
        "base_model": str(zoo["base"]),
        "models": [{"model": str(zoo["base"])}, {"model": str(zoo["a"])}],
        "dtype": "float32",
    }
    compare_with_mergekit(recipe, tmp_path)
