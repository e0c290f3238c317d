"""Model Stock: closed forms, and agreement with mergekit 0.1.5."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from maec_core.errors import RecipeError
from maec_core.parsing import parse_recipe
from tests.core.test_methods import call, close


def test_model_stock_ratio_from_the_angle() -> None:
    base = [0.0, 0.0]
    # Task vectors (1, 0) and (1, 1): cos = 1/√2, N = 2, t = 2c / (1 + c).
    c = 1 / math.sqrt(2)
    t = 2 * c / (1 + c)
    close(call("model_stock", base, [[1.0, 0.0], [1.0, 1.0]]), [t, t / 2])
    # Orthogonal task vectors: t = 0, the base. Identical ones: t = 1, their mean.
    close(call("model_stock", [1.0, 1.0], [[2.0, 1.0], [1.0, 2.0]]), [1.0, 1.0])
    close(call("model_stock", [1.0, 1.0], [[2.0, 3.0], [2.0, 3.0]]), [2.0, 3.0])
    # Opposite task vectors with N = 2: 1 + cos = 0 is the singularity, the base stays.
    close(call("model_stock", [1.0, 1.0], [[2.0, 2.0], [0.0, 0.0]]), [1.0, 1.0])


def test_model_stock_filter_wise_takes_one_ratio_per_row() -> None:
    base = [[0.0, 0.0], [0.0, 0.0]]
    a = [[1.0, 0.0], [1.0, 1.0]]
    b = [[0.0, 1.0], [1.0, 1.0]]
    # Row 0: orthogonal (t = 0); row 1: identical (t = 1). The whole tensor has one t.
    got = call("model_stock", base, [a, b], filter_wise=True)
    close(got.reshape(-1), [0.0, 0.0, 1.0, 1.0])
    whole = call("model_stock", base, [a, b])
    c = 2 / (math.sqrt(3) * math.sqrt(3))
    t = 2 * c / (1 + c)
    close(whole.reshape(-1), [t * 0.5, t * 0.5, t, t])


def test_model_stock_needs_two_models() -> None:
    with pytest.raises(RecipeError, match="at least 2"):
        parse_recipe({"merge_method": "model_stock", "base_model": "b",
                      "models": [{"model": "a"}]})


mergekit = pytest.importorskip("mergekit.merge")


@pytest.mark.slow
@pytest.mark.parametrize("filter_wise", [False, True])
def test_model_stock_agrees_with_mergekit(zoo: dict[str, Path], tmp_path: Path,
                                          filter_wise: bool) -> None:
    from tests.core.test_methods_mergekit import compare_with_mergekit

    recipe: dict[str, Any] = {
        "merge_method": "model_stock",
        "base_model": str(zoo["base"]),
        "models": [{"model": str(zoo["a"])}, {"model": str(zoo["b"])}],
        "parameters": {"filter_wise": filter_wise},
        "dtype": "float32",
    }
    compare_with_mergekit(recipe, tmp_path)
