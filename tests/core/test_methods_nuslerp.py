"""NuSLERP: closed forms, and agreement with mergekit 0.1.5."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from maec_core.errors import RecipeError
from maec_core.parsing import parse_recipe
from tests.core.test_methods import call, close


def test_nuslerp_weights_give_t() -> None:
    a, b = [1.0, 0.0], [0.0, 1.0]
    h = math.sqrt(0.5)
    close(call("nuslerp", None, [a, b]), [h, h])
    # Weights 1 and 2: t = 2/3 of the quarter turn.
    angle = 2 / 3 * math.pi / 2
    close(call("nuslerp", None, [a, b], [{"weight": 1}, {"weight": 2}]),
          [math.cos(angle), math.sin(angle)])
    # Weights summing to about zero interpolate half-way.
    close(call("nuslerp", None, [a, b], [{"weight": 1}, {"weight": -1}]), [h, h])
    # Around a base: the task vectors are interpolated.
    close(call("nuslerp", [1.0, 1.0], [[2.0, 1.0], [1.0, 2.0]]), [1 + h, 1 + h])


def test_nuslerp_parallel_vectors_interpolate_linearly() -> None:
    close(call("nuslerp", None, [[1.0, 2.0], [3.0, 6.0]], [{"weight": 3}, {"weight": 1}]),
          [1.5, 3.0])
    close(call("nuslerp", None, [[1.0, 2.0], [-1.0, -2.0]]), [0.0, 0.0])


def test_nuslerp_rows_and_columns() -> None:
    a = [[1.0, 0.0], [0.0, 2.0]]
    b = [[0.0, 1.0], [0.0, 3.0]]
    mp = [{"weight": 1}, {"weight": 3}]  # t = 3/4
    c0, c1 = math.sin(math.pi / 8), math.sin(3 * math.pi / 8)
    # Rows: (1, 0) → (0, 1) turns by a right angle; (0, 2) and (0, 3) are parallel.
    close(call("nuslerp", None, [a, b], mp, nuslerp_flatten=False).reshape(-1),
          [c0, c1, 0.0, 2.75])
    # Columns: (1, 0) → (0, 0) has no direction (cosine 0: a right angle); (0, 2) → (1, 3)
    # turns by acos(3 / √10).
    theta = math.acos(3 / math.sqrt(10))
    k0, k1 = (math.sin(f * theta) / math.sin(theta) for f in (0.25, 0.75))
    got = call("nuslerp", None, [a, b], mp, nuslerp_flatten=False, nuslerp_row_wise=True)
    close(got.reshape(-1), [c0, k1 * 1.0, 0.0, k0 * 2 + k1 * 3])
    # Flattened (the default), row_wise is ignored.
    close(call("nuslerp", None, [a, b], mp, nuslerp_row_wise=True),
          call("nuslerp", None, [a, b], mp).tolist())


def test_nuslerp_takes_exactly_two_models() -> None:
    with pytest.raises(RecipeError, match="exactly 2"):
        parse_recipe({"merge_method": "nuslerp", "base_model": "b",
                      "models": [{"model": "b"}, {"model": "a"}]})
    parse_recipe({"merge_method": "nuslerp",
                  "models": [{"model": "a", "parameters": {"weight": 0.3}}, {"model": "c"}],
                  "parameters": {"nuslerp_row_wise": True, "nuslerp_flatten": False}})


mergekit = pytest.importorskip("mergekit.merge")


@pytest.mark.slow
@pytest.mark.parametrize("with_base", [True, False])
@pytest.mark.parametrize("params", [{}, {"nuslerp_flatten": False},
                                    {"nuslerp_flatten": False, "nuslerp_row_wise": True}])
def test_nuslerp_agrees_with_mergekit(zoo: dict[str, Path], tmp_path: Path,
                                      with_base: bool, params: dict[str, Any]) -> None:
    from tests.core.test_methods_mergekit import compare_with_mergekit, two_weighted

    compare_with_mergekit(two_weighted(zoo, "nuslerp", params, with_base=with_base), tmp_path)
