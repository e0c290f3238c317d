"""DELLA's MagPrune task vectors added linearly (Deep et al. 2024, arXiv:2406.11617).

Pruning, rescaling and seeding as in :mod:`maec_core.methods.della`; parameter names and
defaults follow mergekit 0.1.5 (``normalize`` off, ``rescale`` on).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from maec_core.methods._common import sum_deltas
from maec_core.methods.base import TensorCall, TensorMethod
from maec_core.methods.della import DellaModelParams, DellaParams, check_bands, della_deltas

if TYPE_CHECKING:
    import torch

    from maec_core.recipe import Recipe


class DellaLinearParams(DellaParams):
    normalize: bool = False


class DellaLinear(TensorMethod):
    name = "della_linear"
    paper = ("Deep et al. 2024, DELLA-Merging (arXiv:2406.11617), task vectors added "
             "linearly")
    params = DellaLinearParams
    model_params = DellaModelParams

    def validate(self, recipe: Recipe) -> None:
        super().validate(recipe)
        check_bands(recipe)

    def merge(self, call: TensorCall) -> torch.Tensor:
        """``θ0 + λ Σ w_i MagPrune(τ_i)`` (divided by ``Σ w_i`` with normalize)."""
        assert call.base is not None
        deltas, weights = della_deltas(call)
        return sum_deltas(call.base, deltas, weights, normalize=call.params.normalize,
                          lambda_=call.params.lambda_)
