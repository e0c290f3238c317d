"""NearSwap: a closed form, and agreement with mergekit 0.1.5."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from maec_core.errors import RecipeError
from maec_core.parsing import parse_recipe
from tests.core.test_methods import call, close


def test_nearswap_swaps_close_entries() -> None:
    base = [0.0, 0.0, 1.0, 5.0]
    other = [0.05, -2.0, 1.0, 4.0]
    # |d| = 0.05, 2, 0, 1 with t = 0.1: w = 1, 0.05, 1, 0.1.
    close(call("nearswap", base, [other], t=0.1), [0.05, -0.1, 1.0, 4.9])
    with pytest.raises(RecipeError, match=r"parameters\.t: Field required"):
        parse_recipe({"merge_method": "nearswap", "base_model": "b",
                      "models": [{"model": "a"}]})


mergekit = pytest.importorskip("mergekit.merge")


@pytest.mark.slow
def test_nearswap_agrees_with_mergekit(zoo: dict[str, Path], tmp_path: Path) -> None:
    from tests.core.test_methods_mergekit import compare_with_mergekit

    recipe: dict[str, Any] = {
        "merge_method": "nearswap",
        "base_model": str(zoo["base"]),
        "models": [{"model": str(zoo["base"])}, {"model": str(zoo["a"])}],
        "parameters": {"t": [{"filter": "mlp", "value": 0.001}, {"value": 0.02}]},
        "dtype": "float32",
    }
    compare_with_mergekit(recipe, tmp_path)
