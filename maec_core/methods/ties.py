"""TIES-Merging: trim, elect sign, disjoint mean (Yadav et al. 2023, arXiv:2306.01708)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from maec_core.methods._common import DensityParams, merge_deltas, weighted_deltas
from maec_core.methods._sparsify import rescale_l1_, trim_magnitude_
from maec_core.methods.base import TensorCall, TensorMethod
from maec_core.methods.task_arithmetic import TaskArithmeticParams

if TYPE_CHECKING:
    import torch


class TiesParams(TaskArithmeticParams):
    normalize: bool = True


class Ties(TensorMethod):
    name = "ties"
    paper = "Yadav et al. 2023, TIES-Merging (arXiv:2306.01708)"
    params = TiesParams
    model_params = DensityParams

    def merge(self, call: TensorCall) -> torch.Tensor:
        """``θ0 + λ · disjoint_mean(sign-elected, top-density w_i τ_i)``, ``τ_i = θ_i − θ0``."""
        base = call.base
        assert base is not None

        def trimmed(t: torch.Tensor, p: DensityParams, _i: int) -> torch.Tensor:
            d = t - base
            before = d.abs().sum() if call.params.rescale else None
            trim_magnitude_(d, p.density)
            if before is not None:
                rescale_l1_(d, before)
            return d

        return merge_deltas(call, *weighted_deltas(call, trimmed), elect=True)
