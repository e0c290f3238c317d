"""DELLA-Merging: MagPrune task vectors, then TIES sign election (Deep et al. 2024,
arXiv:2406.11617).

Each entry of each task vector survives with a probability that grows with its
magnitude rank in its row, from ``density − epsilon`` to ``density + epsilon``
(:func:`maec_core.methods._sparsify.magprune_`); survivors are scaled back to the task
vector's L1 norm (``rescale``), weighted, sign-elected and averaged over the agreeing
models. Parameter names and defaults follow mergekit 0.1.5 (``normalize`` and
``rescale`` on).

Reproducibility as for DARE: one CPU generator per tensor, seeded with the crc32 of
``random_seed`` and the tensor name, draws the masks of the models in recipe order.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, ClassVar

from pydantic import Field

from maec_core.errors import RecipeError
from maec_core.methods._common import DensityParams, merge_deltas, weighted_deltas
from maec_core.methods._sparsify import magprune_, tensor_generator
from maec_core.methods.base import TensorCall, TensorMethod
from maec_core.methods.params import candidate_values
from maec_core.methods.task_arithmetic import TaskArithmeticParams

if TYPE_CHECKING:
    import torch

    from maec_core.recipe import Recipe


class DellaParams(TaskArithmeticParams):
    normalize: bool = True
    rescale: bool = True
    random_seed: int = Field(0, ge=0)


class DellaModelParams(DensityParams):
    # Half-width of the keep-probability range around density.
    epsilon: float = 0.15


def check_band(density: float, epsilon: float, where: str) -> None:
    """MagPrune's probabilities must stay inside (0, 1) wherever it prunes (density < 1)."""
    if density < 1.0 and not (density - epsilon > 0.0 and density + epsilon < 1.0):
        raise RecipeError(
            f"{where}: density ± epsilon must lie strictly between 0 and 1 "
            f"(density {density}, epsilon {epsilon})", density=density, epsilon=epsilon,
        )


def check_bands(recipe: Recipe) -> None:
    """Every pair of density and epsilon values a model's parameters can produce.

    Conditions and gradient end points are paired in every combination (a filter on one
    may meet any value of the other); values between gradient ends are checked again
    per tensor when the merge runs.
    """
    defaults = DellaModelParams.model_fields
    for i, m in enumerate(recipe.models):
        if m.model == recipe.base_model:
            continue
        density = candidate_values(m.parameters.get("density", defaults["density"].default))
        epsilon = candidate_values(m.parameters.get("epsilon", defaults["epsilon"].default))
        for d, e in itertools.product(density, epsilon):
            check_band(float(d), float(e), f"models[{i}].parameters")


def della_deltas(call: TensorCall) -> tuple[list[torch.Tensor], list[float]]:
    """The call's weighted task vectors after MagPrune (and rescale)."""
    base = call.base
    assert base is not None
    gen = tensor_generator(call.params.random_seed, call.name)

    def pruned(t: torch.Tensor, p: DellaModelParams, i: int) -> torch.Tensor:
        check_band(p.density, p.epsilon, f"{call.name}: model {i}")
        return magprune_(t.sub_(base), p.density, p.epsilon, gen,
                         rescale=call.params.rescale)

    return weighted_deltas(call, pruned)


class Della(TensorMethod):
    name = "della"
    paper = ("Deep et al. 2024, DELLA-Merging: reducing interference in model merging "
             "through magnitude-based sampling (arXiv:2406.11617)")
    params = DellaParams
    model_params = DellaModelParams
    # TIES sign election and disjoint mean; off: the task vectors are added linearly.
    elect: ClassVar[bool] = True

    def validate(self, recipe: Recipe) -> None:
        super().validate(recipe)
        check_bands(recipe)

    def merge(self, call: TensorCall) -> torch.Tensor:
        """``θ0 + λ · disjoint_mean(sign-elected w_i MagPrune(τ_i))`` (with ``elect``)."""
        return merge_deltas(call, *della_deltas(call), elect=self.elect)
