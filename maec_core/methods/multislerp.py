"""Multi-SLERP: barycentric interpolation of several models on a hypersphere.

From goddard.blog/posts/multislerp-wow-what-a-cool-idea, as mergekit 0.1.5 runs it.
Each tensor (a task vector when a base is given) is one flat vector ``x_i`` with norm
``n_i`` and direction ``u_i = x_i / (n_i + eps)``. The result points along the
normalised weighted mean ``m = Σ w_i u_i / ‖Σ w_i u_i‖`` and has the weighted mean norm
``Σ w_i n_i``.

Why no tangent-space step: mergekit projects the ``u_i`` onto the tangent space at
``m``, averages them there and maps back; at the weighted Euclidean mean that average
is identically zero (``Σ w_i (u_i − (u_i·m) m) = Σ w_i u_i − ‖Σ w_i u_i‖ m = 0``), so the
map back returns ``m`` itself. Computing ``m`` directly gives the same tensor without
the rounding noise of a sum that cancels.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import Field

from maec_core.errors import MaecError
from maec_core.methods._common import WeightParams
from maec_core.methods.base import Params, TensorCall, TensorMethod
from maec_core.methods.slerp import dot64

if TYPE_CHECKING:
    import torch


class MultiSlerpParams(Params):
    # True: the weights are divided by their sum.
    normalize_weights: bool = True
    # Added to every norm before dividing by it, so a zero tensor has no direction.
    eps: float = Field(1e-8, ge=0.0)


def _weights(call: TensorCall) -> list[float]:
    weights = [float(p.weight) for p in call.model_params]
    if not call.params.normalize_weights:
        return weights
    total = sum(weights)
    if total == 0:
        raise MaecError(f"{call.name}: multislerp weights sum to zero; with "
                        "normalize_weights they must not", tensor=call.name)
    return [w / total for w in weights]


class MultiSlerp(TensorMethod):
    name = "multislerp"
    paper = ("Multi-SLERP: barycentric interpolation on the hypersphere "
             "(goddard.blog/posts/multislerp-wow-what-a-cool-idea)")
    params = MultiSlerpParams
    model_params = WeightParams
    needs_base = False
    min_models = 1

    def merge(self, call: TensorCall) -> torch.Tensor:
        """``base + (Σ w_i n_i) · m`` (no base: 0), with ``m`` the mean direction."""
        import torch

        if len(call.models) == 1:
            return call.models[0]
        xs = [m if call.base is None else m.sub_(call.base) for m in call.models]
        weights = _weights(call)
        eps = call.params.eps
        norms = [math.sqrt(dot64(x.reshape(-1), x.reshape(-1))) for x in xs]
        mean = torch.zeros_like(xs[0])
        for x, w, n in zip(xs, weights, norms, strict=True):
            mean.add_(x, alpha=w / (n + eps))
        mean_norm = math.sqrt(dot64(mean.reshape(-1), mean.reshape(-1)))
        if mean_norm < eps:
            if len(xs) != 2:
                raise MaecError(
                    f"{call.name}: the weighted mean of the multislerp inputs' directions "
                    "is zero (opposite inputs whose weights balance); change the weights",
                    tensor=call.name)
            # Two opposite directions: mergekit falls back to their weighted sum.
            mean = xs[0].mul_(weights[0]).add_(xs[1], alpha=weights[1])
        else:
            mean.mul_(sum(w * n for w, n in zip(weights, norms, strict=True)) / mean_norm)
        return mean if call.base is None else mean.add_(call.base)
