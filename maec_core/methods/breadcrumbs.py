"""Model Breadcrumbs (Davari and Belilovsky 2024, arXiv:2312.06795).

Each task vector loses its largest-magnitude outliers (the ``gamma`` fraction) and then
its smallest entries, so that a ``density`` fraction survives; the survivors are added
as in task arithmetic. Parameter names and defaults follow mergekit 0.1.5.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from pydantic import Field

from maec_core.methods._common import DensityParams, merge_deltas, weighted_deltas
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
    base = call.base
    assert base is not None

    def trimmed(t: torch.Tensor, p: BreadcrumbsModelParams, _i: int) -> torch.Tensor:
        d = t.sub_(base)
        before = d.abs().sum() if call.params.rescale else None
        trim_outliers_(d, p.density, p.gamma)
        if before is not None:
            rescale_l1_(d, before)
        return d

    return weighted_deltas(call, trimmed)


class Breadcrumbs(TensorMethod):
    name = "breadcrumbs"
    paper = ("Davari and Belilovsky 2024, Model Breadcrumbs: scaling multi-task model "
             "merging with sparse masks (arXiv:2312.06795)")
    params = BreadcrumbsParams
    model_params = BreadcrumbsModelParams
    # Off: the task vectors are added; on: TIES sign election and disjoint mean.
    elect: ClassVar[bool] = False

    def merge(self, call: TensorCall) -> torch.Tensor:
        """``θ0 + λ Σ w_i breadcrumbs(τ_i)`` (divided by ``Σ w_i`` with normalize)."""
        return merge_deltas(call, *breadcrumb_deltas(call), elect=self.elect)
