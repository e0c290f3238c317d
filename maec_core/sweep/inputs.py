"""What a recipe's evaluation reads, and which inputs it compares against (torch-free).

Eval set paths in a recipe are sources like its checkpoints: the API resolves them, the
worker fetches them and rewrites them with :func:`with_eval_sources` before scoring.
"""

from __future__ import annotations

from collections.abc import Mapping

from maec_core.eval.sets import EvalSetSpec, EvalSpec
from maec_core.methods import get_method
from maec_core.recipe import Recipe

LANGUAGE_BASE = "language_base"
MERGED = "merged"


def eval_sources(recipe: Recipe) -> list[str]:
    """Every eval set and few-shot file the recipe's ``evaluate`` reads, no repeats."""
    out: list[str] = []
    for s in recipe.evaluate or []:
        if s.kind == "lm_eval" or s.path is None:
            # lm-eval reads its task and data itself (maec_core.eval.lm_eval_tasks).
            continue
        out.append(s.path)
        if s.few_shot is not None:
            out.append(s.few_shot.path)
    return list(dict.fromkeys(out))


def _moved(s: EvalSetSpec, mapping: Mapping[str, str]) -> EvalSetSpec:
    if s.path is None:
        return s
    update: dict[str, object] = {"path": mapping.get(s.path, s.path)}
    if s.few_shot is not None:
        shot = s.few_shot
        update["few_shot"] = shot.model_copy(update={"path": mapping.get(shot.path,
                                                                         shot.path)})
    return s.model_copy(update=update)


def with_eval_sources(recipe: Recipe, mapping: Mapping[str, str]) -> Recipe:
    """A copy whose eval set paths found in ``mapping`` are replaced by their value."""
    if not recipe.evaluate:
        return recipe
    return recipe.model_copy(update={"evaluate": [_moved(s, mapping)
                                                  for s in recipe.evaluate]})


def eval_spec(recipe: Recipe) -> EvalSpec:
    """The recipe's eval sets as an eval spec (paths as they are: local by now)."""
    if not recipe.evaluate:
        raise ValueError("the recipe has no evaluate list")
    return EvalSpec(sets=list(recipe.evaluate))


def language_base(recipe: Recipe) -> str | None:
    """The target-language model the merge builds on, as its method names it
    (:meth:`~maec_core.methods.base.MergeMethod.language_model`)."""
    return get_method(recipe.merge_method).language_model(recipe)


def input_models(recipe: Recipe) -> dict[str, str]:
    """The inputs ``evaluate_inputs`` scores, by row label: the language base, then each
    donor (``donor``, or ``donor0``, ``donor1``... when there are several)."""
    method = get_method(recipe.merge_method)
    lang = method.language_model(recipe)
    donors = list(dict.fromkeys(method.donors(recipe)))
    out = {LANGUAGE_BASE: lang} if lang is not None else {}
    for i, d in enumerate(donors):
        out["donor" if len(donors) == 1 else f"donor{i}"] = d
    return out
