"""NuSLERP: spherical interpolation between two models, weighted like a linear merge.

mergekit 0.1.5's ``nuslerp``: the two models' weights give ``t = w_2 / (w_1 + w_2)``
(0.5 when they sum to about zero); with a base, the two task vectors are interpolated
and added back to it. The vectors are whole flattened tensors (``nuslerp_flatten``,
the default), or the rows along the last dimension, or with ``nuslerp_row_wise`` the
columns (the vectors along the first dimension). Exactly parallel or antiparallel
vectors are interpolated linearly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from maec_core.methods._common import WeightParams
from maec_core.methods.base import Params, TensorCall, TensorMethod

if TYPE_CHECKING:
    import torch

# Weights summing to less than this in magnitude interpolate half-way; vectors whose
# 1 − cos² is at most _COLINEAR² count as parallel; norms are floored at _MIN_NORM.
# mergekit's cut-offs, kept so that recipes agree.
_ZERO_TOTAL = 1e-6
_COLINEAR = 1e-8
_MIN_NORM = 1e-7


class NuSlerpParams(Params):
    # True: interpolate the vectors along the first dimension (columns of a matrix)
    # instead of those along the last (rows); ignored with nuslerp_flatten.
    nuslerp_row_wise: bool = False
    # True: each tensor is one flat vector.
    nuslerp_flatten: bool = True


def slerp_rows(t: float, v0: torch.Tensor, v1: torch.Tensor) -> torch.Tensor:
    """SLERP of each row (last dimension) of ``v0`` toward the same row of ``v1``, op for
    op as mergekit 0.1.5 computes it in the inputs' dtype (the cosine of the normalised
    rows, the result divided by sin θ last), so its bytes come out; float64 cosines here
    had differed from it by a unit in the last place."""
    import torch

    def unit(x: torch.Tensor) -> torch.Tensor:
        return torch.div(x, torch.norm(x, dim=-1, keepdim=True).clamp(min=_MIN_NORM))

    cos = torch.sum(unit(v0) * unit(v1), dim=-1, keepdim=True).clamp(-1, 1)
    colinear = (1 - cos.square()) <= _COLINEAR**2
    theta = torch.acos(torch.where(colinear, 0, cos))
    sin = torch.sin(theta)
    out = (torch.sin((1 - t) * theta) * v0 + torch.sin(t * theta) * v1) / sin
    return torch.where(colinear, (1 - t) * v0 + t * v1, out)


class NuSlerp(TensorMethod):
    name = "nuslerp"
    paper = ("NuSLERP: spherical interpolation with linear-merge weights "
             "(mergekit 0.1.5, github.com/arcee-ai/mergekit)")
    params = NuSlerpParams
    model_params = WeightParams
    needs_base = False
    min_models = 2
    max_models = 2

    def merge(self, call: TensorCall) -> torch.Tensor:
        """SLERP from the first model (t = 0) to the second (t = 1), around the base."""
        w0, w1 = (float(p.weight) for p in call.model_params)
        t = 0.5 if abs(w0 + w1) < _ZERO_TOTAL else w1 / (w0 + w1)
        v0, v1 = call.models
        if call.base is not None:
            v0, v1 = v0.sub_(call.base), v1.sub_(call.base)
        shape = v0.shape
        if call.params.nuslerp_flatten:
            out = slerp_rows(t, v0.reshape(-1), v1.reshape(-1))
        elif call.params.nuslerp_row_wise and v0.dim() > 1:
            # Columns become rows; the result is transposed back below.
            out = slerp_rows(t, v0.transpose(0, -1), v1.transpose(0, -1)).transpose(0, -1)
        else:
            out = slerp_rows(t, v0, v1)
        out = out.reshape(shape)
        return out if call.base is None else call.base + out
