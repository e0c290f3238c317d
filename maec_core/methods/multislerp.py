"""Multi-SLERP: barycentric interpolation of several models on a hypersphere.

From goddard.blog/posts/multislerp-wow-what-a-cool-idea. Each tensor (a task vector
when a base is given) is one flat vector ``x_i`` with norm ``n_i`` and direction
``u_i = x_i / (n_i + eps)``. The directions' weighted mean ``m`` (normalised) is the
point of tangency; the directions are projected onto the tangent space there, averaged
and mapped back; the result has the weighted mean norm ``Σ w_i n_i``.

At the weighted mean that tangent average is zero up to rounding, so the map back
returns about ``m``; it is still computed, op for op as mergekit 0.1.5 does in the
compute dtype, because that rounding is part of mergekit's bytes and a recipe written
for it must give them here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from maec_core.errors import MaecError
from maec_core.methods._common import WeightParams
from maec_core.methods.base import Params, TensorCall, TensorMethod

if TYPE_CHECKING:
    import torch


class MultiSlerpParams(Params):
    # True: the weights are divided by their sum.
    normalize_weights: bool = True
    # Added to every norm before dividing by it, so a zero tensor has no direction.
    eps: float = Field(1e-8, ge=0.0)


def _weights(call: TensorCall) -> list[float]:
    """The weights as given, refused when ``normalize_weights`` would divide by a zero
    sum (mergekit would write NaN)."""
    weights = [float(p.weight) for p in call.model_params]
    if call.params.normalize_weights and sum(weights) == 0:
        raise MaecError(f"{call.name}: multislerp weights sum to zero; with "
                        "normalize_weights they must not", tensor=call.name)
    return weights


class MultiSlerp(TensorMethod):
    name = "multislerp"
    paper = ("Multi-SLERP: barycentric interpolation on the hypersphere "
             "(goddard.blog/posts/multislerp-wow-what-a-cool-idea)")
    params = MultiSlerpParams
    model_params = WeightParams
    needs_base = False
    min_models = 1

    def merge(self, call: TensorCall) -> torch.Tensor:
        """``base + (Σ w_i n_i) · exp_m(Σ w_i log_m(u_i))`` (no base: 0)."""
        import torch

        if len(call.models) == 1:
            return call.models[0]
        x = torch.stack(list(call.models))
        if call.base is not None:
            x -= call.base
        flat = x.view(x.shape[0], -1)
        # The weights in the compute dtype, normalised there, as mergekit holds them.
        w = torch.tensor(_weights(call), dtype=x.dtype, device=x.device)
        if call.params.normalize_weights:
            w = w / w.sum()
        eps = call.params.eps
        norms = torch.norm(flat, dim=-1, keepdim=True)
        units = flat / (norms + eps)
        mean = (units * w.view(-1, 1)).sum(0)
        mean_norm = torch.norm(mean)
        if mean_norm < eps:
            if len(call.models) != 2:
                raise MaecError(
                    f"{call.name}: the weighted mean of the multislerp inputs' directions "
                    "is zero (opposite inputs whose weights balance); change the weights",
                    tensor=call.name)
            # Two opposite directions: mergekit falls back to their weighted sum.
            res = (x[0] * w[0] + x[1] * w[1]).view(x.shape[1:])
            return res if call.base is None else res + call.base
        mean = mean / mean_norm
        dots = (units * mean).sum(-1, keepdim=True)
        tangent = ((units - dots * mean) * w.view(-1, 1)).sum(0)
        size = torch.norm(tangent) + eps
        out = mean * torch.cos(size) + tangent * (torch.sin(size) / size)
        out = (out * (norms.squeeze(-1) * w).sum()).view(x.shape[1:])
        merged: torch.Tensor = out if call.base is None else out + call.base
        return merged
