"""SCE: closed forms, and agreement with mergekit 0.1.5."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from maec_core.errors import RecipeError
from maec_core.parsing import parse_recipe, recipe_warnings
from tests.core.test_methods import call, close


def test_sce_weighs_by_mean_square_and_erases_disagreeing_signs() -> None:
    base = [1.0, 1.0, 1.0, 1.0]
    a = [2.0, -1.0, 4.0, 1.0]  # task vector (1, -2, 3, 0): mean square 3.5
    b = [4.0, 2.0, 0.0, 1.0]   # task vector (3, 1, -1, 0): mean square 2.75
    wa, wb = 3.5 / 6.25, 2.75 / 6.25
    # Entry 0: both positive, weighted mean; entry 1 elects minus (sum -1): a alone;
    # entry 2 elects plus: a alone; entry 3: nobody agrees with a zero, the base stays.
    close(call("sce", base, [a, b]), [1.0 + wa * 1 + wb * 3, -1.0, 4.0, 1.0])


def test_sce_selects_the_entries_that_vary_most() -> None:
    base = [0.0, 0.0, 0.0, 0.0]
    a = [1.0, -2.0, 3.0, 0.0]
    b = [3.0, 1.0, -1.0, 0.0]
    # Variances over the models 1, 2.25, 4, 0: three non-zero, int(3 · 0.5) = 1 kept
    # (entry 2); the weights are then taken from the selected task vectors.
    close(call("sce", base, [a, b], select_topk=0.5), [0.0, 0.0, 3.0, 0.0])
    # 0.7 keeps int(2.1) = 2 entries (1 and 2), where one sign wins each; 0 keeps none
    # and 1 or more keeps all.
    close(call("sce", base, [a, b], select_topk=0.7), [0.0, -2.0, 3.0, 0.0])
    close(call("sce", base, [a, b], select_topk=0.0), [0.0] * 4)
    close(call("sce", base, [a, b], select_topk=1.5), call("sce", base, [a, b]).tolist())


def test_sce_weighs_equally_when_task_vectors_are_tiny() -> None:
    # Mean squares summing to under 1e-6 give equal weights (mergekit's cut-off).
    base = [0.0, 0.0]
    a, b = [1e-4, 1e-4], [3e-4, 3e-4]
    close(call("sce", base, [a, b]), [2e-4, 2e-4])
    big_a, big_b = [1.0, 1.0], [3.0, 3.0]
    close(call("sce", base, [big_a, big_b]), [(1 * 1 + 9 * 3) / 10] * 2)


def test_sce_takes_no_per_model_parameters() -> None:
    # A weight is accepted and reported, not read (mergekit ignores it too).
    recipe = parse_recipe({"merge_method": "sce", "base_model": "b",
                           "models": [{"model": "a", "parameters": {"weight": 1}}]})
    assert recipe_warnings(recipe) == [
        "models[0].parameters.weight ignored: merge_method 'sce' does not read it"]
    with pytest.raises(RecipeError, match="needs base_model"):
        parse_recipe({"merge_method": "sce", "models": [{"model": "a"}]})
    parse_recipe({"merge_method": "sce", "base_model": "b", "models": [{"model": "a"}],
                  "parameters": {"select_topk": 0.3, "int8_mask": True}})


mergekit = pytest.importorskip("mergekit.merge")


@pytest.mark.slow
@pytest.mark.parametrize("params", [{}, {"select_topk": 0.4, "int8_mask": True},
                                    {"select_topk": [{"filter": "mlp", "value": 0.2},
                                                     {"value": 0.9}]}])
def test_sce_agrees_with_mergekit(zoo: dict[str, Path], tmp_path: Path,
                                  params: dict[str, Any]) -> None:
    from tests.core.test_methods_mergekit import compare_with_mergekit

    recipe: dict[str, Any] = {
        "merge_method": "sce",
        "base_model": str(zoo["base"]),
        "models": [{"model": str(zoo["a"])}, {"model": str(zoo["b"])}],
        "parameters": params,
        "dtype": "float32",
    }
    compare_with_mergekit(recipe, tmp_path)
