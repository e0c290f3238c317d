"""Linear averaging (Wortsman et al. 2022, Model soups, arXiv:2203.05482).

Computed in mergekit's order: a float32 accumulation of ``w_j x_j``, then the division
by ``Σ w_j``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from maec_core.methods._common import WeightParams
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
        normalize). The base model, when given, takes part like any other model.

        As mergekit 0.1.5 computes it, so its bytes come out in every dtype: the sum
        accumulated in float32 (float64 for float64 inputs), then divided by the summed
        weights, then cast back to the inputs' dtype. (Folding 1/Σw into each weight
        first differed from it by a unit in the last place.)"""
        import torch

        tensors = ([call.base] if call.base is not None else []) + list(call.models)
        weights = ([1.0] if call.base is not None else []) + [
            p.weight for p in call.model_params
        ]
        first = tensors[0]
        dtype = torch.float64 if first.dtype == torch.float64 else torch.float32
        coefficients = torch.tensor(weights, dtype=dtype, device=first.device)
        result = torch.zeros_like(first, dtype=dtype)
        for tensor, coefficient in zip(tensors, coefficients.unbind(0), strict=True):
            result.addcmul_(tensor, coefficient)
        total = coefficients.sum()
        # A zero total would make every entry inf or NaN: the plain sum is kept instead.
        if call.params.normalize and float(total) != 0.0:
            result.div_(total)
        return result.to(first.dtype)

    def merge_into(self, call: TensorCall, out: torch.Tensor, compute: torch.dtype
                   ) -> bool | None:
        """:meth:`merge` of flat slices in one compiled pass (``maec_core.native``), the
        same bytes; see the base class."""
        import torch

        from maec_core.native import linear

        tensors = ([call.base] if call.base is not None else []) + list(call.models)
        weights = ([1.0] if call.base is not None else []) + [
            p.weight for p in call.model_params
        ]
        # The coefficients and their sum exactly as merge holds them (float32).
        coefficients = torch.tensor(weights, dtype=torch.float32)
        total = float(coefficients.sum())
        divide = call.params.normalize and total != 0.0
        return linear(tensors, coefficients.tolist(), total if divide else None, compute, out)
