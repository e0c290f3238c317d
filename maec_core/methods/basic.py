"""Linear averaging and task arithmetic."""

from __future__ import annotations

import torch

from maec_core.methods.base import TensorCall
from maec_core.methods.registry import register


@register("linear")
def linear(call: TensorCall) -> torch.Tensor:
    """Weighted average ``Σ w_i θ_i / Σ w_i`` (or the plain weighted sum if not normalize).

    Wortsman et al. 2022. The base model, when given, takes part like any other model.
    """
    tensors = ([call.base] if call.base is not None else []) + list(call.models)
    weights = ([1.0] if call.base is not None else []) + [p.weight for p in call.model_params]
    out = torch.zeros_like(tensors[0])
    for t, w in zip(tensors, weights, strict=True):
        out.add_(t, alpha=w)
    total = sum(weights)
    if call.params.normalize and total != 0:
        out.div_(total)
    return out


@register("task_arithmetic")
def task_arithmetic(call: TensorCall) -> torch.Tensor:
    """``θ0 + λ Σ w_i (θ_i − θ0)`` (Ilharco et al. 2023); normalize divides by ``Σ w_i``."""
    assert call.base is not None
    weights = [p.weight for p in call.model_params]
    delta = torch.zeros_like(call.base)
    for t, w in zip(call.models, weights, strict=True):
        delta.add_(t, alpha=w)
    # Σ w_i (θ_i − θ0) = Σ w_i θ_i − (Σ w_i) θ0: one pass per model instead of two.
    delta.add_(call.base, alpha=-sum(weights))
    if call.params.normalize and sum(weights) != 0:
        delta.div_(sum(weights))
    return delta.mul_(call.params.lambda_).add_(call.base)
