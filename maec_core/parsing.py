"""From recipe text to a checked ``Recipe``: the one place a recipe is validated.

Two layers meet here and nowhere else. ``maec_core.recipe`` is the data model (fields,
shapes, cross-field rules) and knows no method; ``maec_core.methods`` knows each method
and reads recipes. :func:`parse_recipe` loads the model, then asks the recipe's method
to check it (names, model counts, every parameter's name and range), so neither layer
imports the other back.

Torch-free: the API parses every submitted recipe here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from maec_core.methods.registry import get_method
from maec_core.recipe import Recipe, load_recipe

__all__ = ["parse_recipe", "recipe_warnings", "validate_recipe"]


def validate_recipe(recipe: Recipe) -> None:
    """Check method name, model counts and every parameter's name and range."""
    get_method(recipe.merge_method).validate(recipe)


def recipe_warnings(recipe: Recipe) -> list[str]:
    """What a valid recipe says that its merge does not use (unknown top-level keys,
    parameters the method does not read, names no method knows), one line each: the CLI
    prints them, the job record and the model card list them."""
    return recipe.recipe_warnings() + get_method(recipe.merge_method).ignored(recipe)


def parse_recipe(source: Recipe | Mapping[str, Any] | str | Path) -> Recipe:
    """Load a recipe from a model, a mapping, a YAML file path, or YAML text, checked
    by its method (a ``Recipe`` given is taken as it is)."""
    if isinstance(source, Recipe):
        return source
    recipe = load_recipe(source)
    validate_recipe(recipe)
    # Checked here, not only when the writer asks: the API validates with parse_recipe
    # before queueing, and a bad size must be a 422, not a failed job.
    recipe.shard_size_bytes()
    return recipe
