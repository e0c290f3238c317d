"""planned_shard_count: a merge's output shard count from its inputs' headers alone (what a
split merge cuts into parts) is the count the merge writes; None where it is not split."""

from __future__ import annotations

from pathlib import Path

import pytest

from maec_core.parsing import parse_recipe
from maec_core.run import run
from maec_core.service.running import planned_shard_count


@pytest.mark.parametrize(("method", "size"), [("ties", "20KB"), ("linear", "50KB"),
                                              ("linear", "5GB")])
def test_planned_shard_count_is_the_merges(zoo: dict[str, Path], tmp_path: Path,
                                           method: str, size: str) -> None:
    extra = {"density": 0.5} if method == "ties" else {}
    recipe = parse_recipe({
        "merge_method": method, "base_model": str(zoo["base"]), "out_shard_size": size,
        "dtype": "bfloat16",
        "models": [{"model": str(zoo["a"]), "parameters": {"weight": 0.6, **extra}},
                   {"model": str(zoo["b"]), "parameters": {"weight": 0.4, **extra}}]})
    run(recipe, tmp_path / "out")
    made = len(list((tmp_path / "out").glob("model*.safetensors")))
    assert planned_shard_count(recipe) == made


@pytest.mark.parametrize("dtype", ["bfloat16", None])
def test_planned_shard_count_of_a_maec_merge_is_the_combinations(
        zoo: dict[str, Path], tmp_path: Path, dtype: str | None) -> None:
    """MAEC splits in phases (its selection is made once): its count is its output's."""
    recipe = parse_recipe({
        "merge_method": "maec", "base_model": str(zoo["base"]),
        "language_base": str(zoo["b"]), "abilities": [{"model": str(zoo["a"])}],
        "out_shard_size": "20KB", **({"dtype": dtype} if dtype else {})})
    run(recipe, tmp_path / "out")
    made = len(list((tmp_path / "out").glob("model*.safetensors")))
    assert made > 1 and planned_shard_count(recipe) == made
