"""MAEC as a registered method: its parameters, validation and named-form mapping.

The method itself (extraction, selection, combination) lives in ``maec_core.maec`` and
runs through its own pipeline, not tensor by tensor; this unit only delegates to the
torch-free ``maec_core.maec.params`` so the API finds MAEC like any other method.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from maec_core.errors import RecipeError
from maec_core.maec.params import (
    EXTRACTION_FIELDS,
    GRADIENT_FIELDS,
    AbilityParams,
    MaecInputs,
    MaecParams,
    language_base_of,
    maec_inputs,
    maec_params,
    validate_maec_recipe,
)
from maec_core.methods.base import (
    Made,
    MergeMethod,
    NamedForm,
    OwnVocab,
    PhasedMerge,
    ReuseKey,
    per_model,
)

if TYPE_CHECKING:
    from pathlib import Path

    import click

    from maec_core.artifact_store import ArtifactStore
    from maec_core.context import RunContext
    from maec_core.io.folder import ModelFolder
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
    inputs = MaecInputs
    entries = "abilities"
    entry_knobs = frozenset({"mu"})

    def check_plan(self, recipe: Recipe, tensors: Iterable[tuple[str, int]]) -> None:
        """Every include pattern matches a tensor and the selection is not empty."""
        maec_params(recipe).check_selection(tensors)

    def run(self, recipe: Recipe, out: Path, ctx: RunContext) -> MergeResult:
        """Extraction (or artifact reuse), then combination (``maec_core.maec.pipeline``;
        imported here, when run: it needs torch and this module must not)."""
        from maec_core.maec.pipeline import run_maec

        return run_maec(recipe, out, ctx)

    def phased(self, recipe: Recipe) -> PhasedMerge | None:
        """Split into parts: the ability vectors found or extracted once, c_t measured
        in parts, the selection made once, then combined in parts
        (``maec_core.maec.phases``; imported when asked, as it needs torch)."""
        from maec_core.maec.phases import MaecPhases

        return MaecPhases(recipe)

    def reuse_key(self, recipe: Recipe) -> ReuseKey | None:
        """The extraction parameters as given (defaults left to the artifact key): equal
        keys mean one ability vector per donor serves every candidate of the group."""
        fields = (*EXTRACTION_FIELDS, *GRADIENT_FIELDS)
        return tuple(sorted((k, v) for k, v in recipe.parameters.items()
                            if k in fields and isinstance(v, int | float)))

    def made(self, result: MergeResult, store: ArtifactStore) -> Made | None:
        """The stored ability vectors the run used (extracted or reused) and the c_t it
        measured against the language base; None unless every one is in ``store``."""
        from maec_core.maec.artifact import WEIGHTS_NAME
        from maec_core.maec.pipeline import report_cosines

        report = result.report or {}
        dirs = [store.get(k) for k in report.get("artifact_keys", [])]
        held = [d for d in dirs if d is not None]
        if len(held) != len(dirs):
            return None
        return Made(files=[d / WEIGHTS_NAME for d in held],
                    state=(held, report_cosines(report)))

    def run_reusing(self, recipe: Recipe, made: Made, out: Path, ctx: RunContext
                    ) -> dict[str, Any]:
        """Only the combination, from the group's stored ability vectors and c_t; the
        folder's manifest."""
        from maec_core.maec.pipeline import combine

        dirs, cosines = made.state
        return combine(recipe, dirs, out, ctx, cosines=cosines).manifest

    def own_vocab(self, recipe: Recipe, folders: Mapping[str, ModelFolder]) -> OwnVocab | None:
        """The language base's vocabulary, with the rows its token map says (the map
        itself is rebuilt where the combination runs)."""
        from maec_core.maec.vocab import maec_token_map

        assert recipe.base_model is not None
        donors = [folders[s.ref] for s in recipe.sources()
                  if s.role in ("ability_donor", "ability_control")]
        tmap = maec_token_map(recipe, folders[recipe.base_model],
                              folders[language_base_of(recipe)], donors)
        return OwnVocab(tmap.lang_rows if tmap else None)

    def entry_count(self, recipe: Recipe) -> int:
        return len(maec_inputs(recipe).abilities)

    def with_entry_value(self, recipe: Recipe, key: str, index: int | None,
                         value: float) -> Recipe:
        own = maec_inputs(recipe)
        abilities = [a.model_copy(update={key: float(value)}) if index in (None, i) else a
                     for i, a in enumerate(own.abilities)]
        return recipe.with_inputs(own.model_copy(update={"abilities": abilities}))

    def language_model(self, recipe: Recipe) -> str | None:
        return maec_inputs(recipe).language_base

    def donors(self, recipe: Recipe) -> list[str]:
        return [a.model for a in maec_inputs(recipe).abilities] or super().donors(recipe)

    def held_input(self, recipe: Recipe) -> str | None:
        """The language base: every candidate's combination reads it whole."""
        return maec_inputs(recipe).language_base

    def refuse_own_inputs(self, recipe: Recipe, method: str) -> None:
        # Another method's recipe keeps these keys as unknown ones (given with their
        # defaults, the recipe drops them): refused here, by name.
        if set(recipe.model_extra or {}) & set(MaecInputs.model_fields):
            raise RecipeError(
                "language_base, abilities and artifact are MAEC fields; "
                f"merge_method '{method}' takes models",
            )

    def refuse_own_named_inputs(self, form: NamedForm, method: str) -> None:
        if form.source_control is not None or form.ability_corpus is not None:
            raise RecipeError("source_control and ability_corpus are MAEC inputs; "
                              f"method '{method}' does not use them")

    def check_service(self, recipe: Recipe) -> None:
        if maec_inputs(recipe).artifact is not None:
            raise RecipeError("recipe.artifact is not accepted by the service: ability "
                              "vectors are cached and reused automatically by content",
                              key="artifact")

    def commands(self) -> list[click.Command]:
        """``maec extract``, ``maec combine`` and ``maec extract-lora``."""
        from maec_core.maec.cli import COMMANDS

        return COMMANDS

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
