"""The method registry's torch-free half: names, papers and typed parameters.

The API validates recipes against these specs without importing torch; the tensor
functions that implement each method live in sibling modules and are looked up through
``maec_core.methods.registry``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from maec_core.errors import RecipeError
from maec_core.methods.params import candidate_values
from maec_core.recipe import Recipe


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NoModelParams(_Params):
    pass


class WeightParams(_Params):
    weight: float = 1.0


class DensityParams(_Params):
    weight: float = 1.0
    density: float = Field(1.0, gt=0.0, le=1.0)


class LinearParams(_Params):
    normalize: bool = True


class TaskArithmeticParams(_Params):
    normalize: bool = False
    lambda_: float = Field(1.0, alias="lambda")
    # Accepted so mergekit recipes run unchanged; masks are a GPU-memory trick there and
    # have no effect on results here.
    int8_mask: bool = False


class TiesParams(TaskArithmeticParams):
    normalize: bool = True


class DareParams(TaskArithmeticParams):
    # mergekit 0.1.5 defaults for dare_linear and dare_ties: no normalisation, rescale on.
    normalize: bool = False
    # True: survivors are scaled by 1/density, as in Yu et al. 2024 (mergekit instead
    # matches the L1 norm of the dropped delta); False: no rescaling.
    rescale: bool = True
    random_seed: int = Field(0, ge=0)


class SlerpParams(_Params):
    t: float = Field(0.5, ge=0.0, le=1.0)
    eps: float = Field(1e-8, gt=0.0)


class LayerSwapModelParams(_Params):
    role: Literal["ability", "language"]


class LayerSwapParams(_Params):
    bottom_k: int = Field(1, ge=0)
    top_k: int = Field(1, ge=0)
    transition: int = Field(0, ge=0)
    # Where tensors outside the transformer blocks come from. "position" (default): the
    # embedding travels with the bottom block and the final norm and lm_head with the top
    # block, so they come from the language expert exactly when that end is swapped
    # (bottom_k > 0, top_k > 0). "ability" or "language" take them all from one expert.
    non_layer: Literal["position", "ability", "language"] = "position"


@dataclass(frozen=True)
class MethodSpec:
    name: str
    paper: str
    params: type[BaseModel]
    model_params: type[BaseModel]
    needs_base: bool
    min_models: int
    max_models: int | None = None


SPECS: dict[str, MethodSpec] = {
    s.name: s
    for s in (
        MethodSpec("linear", "Wortsman et al. 2022, Model soups (arXiv:2203.05482)",
                   LinearParams, WeightParams, needs_base=False, min_models=1),
        MethodSpec("task_arithmetic", "Ilharco et al. 2023, Editing models with task "
                   "arithmetic (arXiv:2212.04089)", TaskArithmeticParams, WeightParams,
                   needs_base=True, min_models=1),
        MethodSpec("ties", "Yadav et al. 2023, TIES-Merging (arXiv:2306.01708)",
                   TiesParams, DensityParams, needs_base=True, min_models=1),
        MethodSpec("dare_linear", "Yu et al. 2024, Language models are Super Mario "
                   "(arXiv:2311.03099)", DareParams, DensityParams, needs_base=True,
                   min_models=1),
        MethodSpec("dare_ties", "Yu et al. 2024, Language models are Super Mario "
                   "(arXiv:2311.03099) with TIES sign election", DareParams, DensityParams,
                   needs_base=True, min_models=1),
        MethodSpec("slerp", "Shoemake 1985 spherical interpolation, as used for LLM merges",
                   SlerpParams, NoModelParams, needs_base=True, min_models=1, max_models=1),
        MethodSpec("layer_swap", "Bandarkar et al. 2024, Layer swapping for zero-shot "
                   "cross-lingual transfer (arXiv:2410.01335)", LayerSwapParams,
                   LayerSwapModelParams, needs_base=False, min_models=2, max_models=2),
        MethodSpec("maec", "Chen et al. 2025, Extracting and Combining Abilities for "
                   "Multi-lingual Ability-enhanced LLMs (EMNLP 2025)", NoModelParams,
                   NoModelParams, needs_base=True, min_models=0, max_models=0),
    )
}


def get_spec(name: str) -> MethodSpec:
    spec = SPECS.get(name)
    if spec is None:
        raise RecipeError(
            f"unknown merge_method '{name}'; known: {', '.join(sorted(SPECS))}",
            merge_method=name,
            known=sorted(SPECS),
        )
    return spec


def _check(model: type[BaseModel], values: dict[str, object], where: str) -> None:
    """Validate every scalar each parameter may take (conditions and gradients included)."""
    lists = {k: candidate_values(v) for k, v in values.items()}  # type: ignore[arg-type]
    width = max((len(v) for v in lists.values()), default=0)
    for i in range(max(width, 1)):
        sample = {k: v[min(i, len(v) - 1)] for k, v in lists.items() if v}
        try:
            model.model_validate(sample)
        except ValidationError as exc:
            problems = []
            for err in exc.errors():
                key = ".".join(str(p) for p in err["loc"])
                if err["type"] == "extra_forbidden":
                    problems.append(f"unknown parameter '{key}' in {where}")
                else:
                    problems.append(f"{where}.{key}: {err['msg']}")
            raise RecipeError("; ".join(problems), problems=problems) from None


def validate_recipe(recipe: Recipe) -> None:
    """Check method name, model counts and every parameter's name and range."""
    spec = get_spec(recipe.merge_method)
    if recipe.merge_method == "maec":
        from maec_core.maec.params import validate_maec_recipe

        validate_maec_recipe(recipe)
        return
    if recipe.language_base is not None or recipe.abilities or recipe.artifact:
        raise RecipeError(
            "language_base, abilities and artifact are MAEC fields; "
            f"merge_method '{spec.name}' takes models",
        )
    if spec.needs_base and not recipe.base_model:
        raise RecipeError(f"merge_method '{spec.name}' needs base_model")
    n = len([m for m in recipe.models if m.model != recipe.base_model])
    if n < spec.min_models or (spec.max_models is not None and n > spec.max_models):
        want = (f"exactly {spec.min_models}" if spec.max_models == spec.min_models
                else f"at least {spec.min_models}")
        if spec.max_models is not None and spec.max_models != spec.min_models:
            want += f" and at most {spec.max_models}"
        raise RecipeError(
            f"merge_method '{spec.name}' takes {want} model(s) besides base_model, got {n}"
        )
    _check(spec.params, dict(recipe.parameters), "parameters")
    for i, m in enumerate(recipe.models):
        _check(spec.model_params, dict(m.parameters), f"models[{i}].parameters")
    if spec.name == "layer_swap":
        roles = sorted(str(m.parameters.get("role")) for m in recipe.models)
        if roles != ["ability", "language"]:
            raise RecipeError("layer_swap needs one model with role: ability and one with "
                              "role: language")
