"""Linear averaging (Wortsman et al. 2022, Model soups, arXiv:2203.05482).

Linear in the inputs, so computed as ``Σ c_j x_j`` with the coefficients folded in
Python first: one multiply and one fused multiply-add per input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from maec_core.methods._common import WeightParams, weighted_sum
from maec_core.methods.base import Params, TensorCall, TensorMethod

if TYPE_CHECKING:
    import torch


class LinearParams(Params):
    normalize: bool = True


class Linear(TensorMethod):
    name = "linear"
    paper = "Wortsman et al. 2022, Model soups (arXiv:2203.05482)"
    params = LinearParams
    model_params = WeightParams
    needs_base = False
    # The base takes part like any other model, with its own weight (mergekit's linear
    # gives base_model no special role).
    uses_base = False
    min_models = 1
    elementwise = True

    def merge(self, call: TensorCall) -> torch.Tensor:
        """Weighted average ``Σ w_i θ_i / Σ w_i`` (or the plain weighted sum if not
        normalize). The base model, when given, takes part like any other model."""
        tensors = ([call.base] if call.base is not None else []) + list(call.models)
        weights = ([1.0] if call.base is not None else []) + [
            p.weight for p in call.model_params
        ]
        total = sum(weights)
        scale = 1.0 / total if call.params.normalize and total != 0 else 1.0
        return weighted_sum(tensors, [w * scale for w in weights])
