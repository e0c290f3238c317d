"""Model Breadcrumbs task vectors combined with TIES sign election and disjoint mean.

Trimming as in :mod:`maec_core.methods.breadcrumbs`; parameter names and defaults follow
mergekit 0.1.5 (normalize off).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from maec_core.methods._common import elect_and_merge
from maec_core.methods.base import TensorCall, TensorMethod
from maec_core.methods.breadcrumbs import (
    BreadcrumbsModelParams,
    BreadcrumbsParams,
    breadcrumb_deltas,
)

if TYPE_CHECKING:
    import torch


class BreadcrumbsTies(TensorMethod):
    name = "breadcrumbs_ties"
    paper = ("Davari and Belilovsky 2024, Model Breadcrumbs (arXiv:2312.06795) with "
             "TIES sign election")
    params = BreadcrumbsParams
    model_params = BreadcrumbsModelParams

    def merge(self, call: TensorCall) -> torch.Tensor:
        """``θ0 + λ · disjoint_mean(sign-elected breadcrumbs(w_i τ_i))``."""
        assert call.base is not None
        deltas, weights = breadcrumb_deltas(call)
        return elect_and_merge(
            call.base, deltas, weights, normalize=call.params.normalize,
            lambda_=call.params.lambda_,
        )
