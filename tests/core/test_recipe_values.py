"""Recipe parameter values: regex lists for MAEC, numbers for the engine methods."""

from __future__ import annotations

import pytest

from maec_core.errors import RecipeError
from maec_core.maec.params import maec_params
from maec_core.parsing import parse_recipe


def _maec(parameters: dict[str, object]) -> dict[str, object]:
    return {
        "merge_method": "maec",
        "base_model": "/m/base",
        "language_base": "/m/lang",
        "abilities": [{"model": "/m/donor"}],
        "parameters": parameters,
    }


def test_maec_include_and_exclude_take_lists_of_patterns() -> None:
    recipe = parse_recipe(_maec({"include": [r"\.mlp\.", r"\.self_attn\."], "exclude": ["q_proj"]}))
    params = maec_params(recipe)
    assert params.is_included("model.layers.3.mlp.down_proj.weight", 2)
    assert params.is_included("model.layers.3.self_attn.o_proj.weight", 2)
    assert not params.is_included("model.layers.3.self_attn.q_proj.weight", 2)
    assert not params.is_included("model.embed_tokens.weight", 2)


def test_a_list_of_strings_is_no_number_for_engine_methods() -> None:
    bad = {
        "merge_method": "ties",
        "base_model": "/m/base",
        "models": [{"model": "/m/a", "parameters": {"weight": ["x", "y"], "density": 0.5}}],
    }
    with pytest.raises(RecipeError, match=r"models\[0\]\.parameters\.weight"):
        parse_recipe(bad)
