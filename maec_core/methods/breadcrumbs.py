"""Model Breadcrumbs (Davari and Belilovsky 2024, arXiv:2312.06795).

Each task vector loses its largest-magnitude outliers (the ``gamma`` fraction) and then
its smallest entries, so that a ``density`` fraction survives; the survivors are added
as in task arithmetic. Parameter names and defaults follow mergekit 0.1.5.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from maec_core.methods._common import DensityParams, sum_deltas
from maec_core.methods._sparsify import rescale_l1_, trim_outliers_
from maec_core.methods.base import TensorCall, TensorMethod
from maec_core.methods.task_arithmetic import TaskArithmeticParams

if TYPE_CHECKING:
    import torch


class BreadcrumbsParams(TaskArithmeticParams):
    normalize: bool = False
    # True: each trimmed task vector is scaled back to the L1 norm it had before
    # trimming (mergekit's rescale for this family).
    rescale: bool = False


class BreadcrumbsModelParams(DensityParams):
    # Fraction of entries, largest in magnitude, removed as outliers.
    gamma: float = Field(0.01, ge=0.0, le=1.0)


def breadcrumb_deltas(call: TensorCall) -> tuple[list[torch.Tensor], list[float]]:
    """The call's weighted task vectors with outliers and small entries removed."""
    assert call.base is not None
    deltas, weights = [], []
    for t, p in zip(call.models, call.model_params, strict=True):
        d = t.sub_(call.base)
        before = d.abs().sum() if call.params.rescale else None
        trim_outliers_(d, p.density, p.gamma)
        if before is not None:
            rescale_l1_(d, before)
        deltas.append(d.mul_(p.weight))
        weights.append(p.weight)
    return deltas, weights


class Breadcrumbs(TensorMethod):
    name = "breadcrumbs"
    paper = ("Davari and Belilovsky 2024, Model Breadcrumbs: scaling multi-task model "
             "merging with sparse masks (arXiv:2312.06795)")
    params = BreadcrumbsParams
    model_params = BreadcrumbsModelParams

    def merge(self, call: TensorCall) -> torch.Tensor:
        """``θ0 + λ Σ w_i breadcrumbs(τ_i)`` (divided by ``Σ w_i`` with normalize)."""
        assert call.base is not None
        deltas, weights = breadcrumb_deltas(call)
        return sum_deltas(call.base, deltas, weights, normalize=call.params.normalize,
                          lambda_=call.params.lambda_)
