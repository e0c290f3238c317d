"""DARE task vectors combined with TIES sign election (Yu et al. 2024, arXiv:2311.03099).

Drop, rescale and seeding as in :mod:`maec_core.methods.dare_linear`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from maec_core.methods._common import DensityParams, elect_and_merge
from maec_core.methods.base import TensorCall, TensorMethod
from maec_core.methods.dare_linear import DareParams, dropped_deltas

if TYPE_CHECKING:
    import torch


class DareTies(TensorMethod):
    name = "dare_ties"
    paper = ("Yu et al. 2024, Language models are Super Mario (arXiv:2311.03099) "
             "with TIES sign election")
    params = DareParams
    model_params = DensityParams

    def merge(self, call: TensorCall) -> torch.Tensor:
        """DARE task vectors combined with TIES sign election and disjoint mean."""
        assert call.base is not None
        deltas, weights = dropped_deltas(call)
        return elect_and_merge(
            call.base, deltas, weights, normalize=call.params.normalize,
            lambda_=call.params.lambda_,
        )
