"""MAEC as a registered method: its parameters, validation and named-form mapping.

The method itself (extraction, selection, combination) lives in ``maec_core.maec`` and
runs through its own pipeline, not tensor by tensor; this unit only delegates to the
torch-free ``maec_core.maec.params`` so the API finds MAEC like any other method.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from maec_core.errors import RecipeError
from maec_core.maec.params import AbilityParams, MaecParams, maec_params, validate_maec_recipe
from maec_core.methods.base import MergeMethod, NamedForm, per_model

if TYPE_CHECKING:
    from pathlib import Path

    from maec_core.context import RunContext
    from maec_core.recipe import Recipe
    from maec_core.runtime import MergeResult


class Maec(MergeMethod):
    name = "maec"
    paper = ("Chen et al. 2025, Extracting and Combining Abilities for Multi-lingual "
             "Ability-enhanced LLMs (EMNLP 2025)")
    params = MaecParams
    # Per ability (donor): the named form's ``mu``.
    model_params = AbilityParams
    min_models = 0
    max_models = 0
    float32_only = True
    stages = ("extract", "combine")
    needs_language_base = True
    ability_knobs = frozenset({"mu"})

    def check_plan(self, recipe: Recipe, tensors: Iterable[tuple[str, int]]) -> None:
        """Every include pattern matches a tensor and the selection is not empty."""
        maec_params(recipe).check_selection(tensors)

    def run(self, recipe: Recipe, out: Path, ctx: RunContext) -> MergeResult:
        """Extraction (or artifact reuse), then combination (``maec_core.maec.pipeline``;
        imported here, when run: it needs torch and this module must not)."""
        from maec_core.maec.pipeline import run_maec

        return run_maec(recipe, out, ctx)

    def validate(self, recipe: Recipe) -> None:
        # mergekit's recipe shapes the MAEC pipeline does not read: refused, not ignored.
        if recipe.layered:
            key = "slices" if recipe.slices is not None else "modules"
            raise RecipeError("merge_method 'maec' takes language_base and abilities, "
                              f"not {key}", key=key)
        if recipe.out_dtype is not None:
            raise RecipeError("merge_method 'maec' sets its output dtype with dtype, "
                              "not out_dtype", key="out_dtype")
        validate_maec_recipe(recipe)

    def ignored(self, recipe: Recipe) -> list[str]:
        # MAEC's parameters are its own model (maec_core.maec.params), which refuses an
        # unknown key: a typo in a MAEC knob must not silently leave the default.
        return []

    def named_form(self, form: NamedForm) -> dict[str, Any]:
        """Each donor is one ability (sharing the control and corpus); ``mu`` is one
        value for all donors or one per donor."""
        params = dict(form.parameters)
        mu = per_model(params.pop("mu", 1.0), len(form.ability_donor), "mu")
        abilities = []
        for donor, m in zip(form.ability_donor, mu, strict=True):
            # mu unconverted: a bad value becomes a recipe error naming it.
            ability: dict[str, Any] = {"model": donor, "mu": m}
            if form.source_control is not None:
                ability["control"] = form.source_control
            if form.ability_corpus is not None:
                ability["corpus"] = form.ability_corpus
            abilities.append(ability)
        return {
            "merge_method": self.name, "base_model": form.base,
            "language_base": form.language_base, "abilities": abilities,
            "parameters": params,
        }
