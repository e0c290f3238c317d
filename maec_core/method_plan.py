"""A registered tensor method's merge planned from the recipe and its inputs' headers:
the models opened and keyed, the vocabulary, the tensors, the output dtype. What the
engine (``run_method``), a split merge's shard layout and the torch-free kernel merge
(``maec_core.kernel_merge``) all start from, so they plan the same merge.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from maec_core.io.folder import ModelFolder, open_model_folder
from maec_core.io.headers import TensorInfo
from maec_core.methods import TensorMethod
from maec_core.plan import MergePlan, PlannedTensor, build_plan, recipe_vocab, rows_of
from maec_core.recipe import Recipe
from maec_core.vocab.build import VocabPlan

__all__ = ["MethodPlan", "model_keys", "open_models", "plan_method"]


def model_keys(recipe: Recipe, separate_base: bool = True
               ) -> tuple[str | None, list[tuple[str, str]]]:
    """(base key, [(key, path)] for the other models); keys are unique, readable names.
    Without ``separate_base`` the base, listed among the models, is one of them."""
    others: list[tuple[str, str]] = []
    seen: set[str] = set()
    base_key = recipe.base_model if separate_base else None
    if base_key:
        seen.add(base_key)
    for m in recipe.models:
        if separate_base and m.model == recipe.base_model:
            continue
        key, n = m.model, 2
        while key in seen:
            key, n = f"{m.model}#{n}", n + 1
        seen.add(key)
        others.append((key, m.model))
    return base_key, others


def open_models(named: Mapping[str, str], base: str | None = None) -> dict[str, ModelFolder]:
    """Open and validate each checkpoint folder (headers and configs only); a LoRA
    adapter among them applies to ``base`` (the recipe's base model) when given."""
    return {key: open_model_folder(path, base=base, config_base=True)
            for key, path in named.items()}


@dataclasses.dataclass(frozen=True)
class MethodPlan:
    """``plan`` of the recipe's models keyed ``named`` (key -> path as the recipe gives
    it): ``base_key`` (None: the method has no separate base), the other models' keys in
    recipe order, the plan's ``reference`` model, the vocabulary plan, and the output's
    dtype name."""

    plan: MergePlan
    named: dict[str, str]
    base_key: str | None
    others: list[str]
    reference: str
    vocab: VocabPlan | None
    out_dtype: str

    @property
    def keys(self) -> list[str]:
        """The models read for each tensor, in order: the base first when separate."""
        return ([self.base_key] if self.base_key else []) + self.others

    def read(self, t: PlannedTensor) -> list[TensorInfo]:
        """The stored tensors a merge of ``t`` reads."""
        return [t.sources[k] for k in self.keys]


def plan_method(recipe: Recipe, spec: TensorMethod) -> MethodPlan:
    """Open the recipe's models (headers and configs) and plan ``spec``'s merge of them.
    A method that merges its base like any other model (linear) reads the base's own
    parameters when the base is listed among the models, as mergekit does."""
    base_key, others = model_keys(recipe, spec.separate_base(recipe))
    named = {**({base_key: base_key} if base_key else {}), **dict(others)}
    folders = open_models(named, recipe.base_model)
    reference = base_key or (recipe.base_model if recipe.base_model in named
                             else others[0][0])
    vocab = recipe_vocab(recipe, folders)
    plan = build_plan(folders, reference, rows_of(vocab))
    return MethodPlan(plan, named, base_key, [k for k, _ in others], reference, vocab,
                      spec.saved_dtype(recipe, plan.input_dtype))
