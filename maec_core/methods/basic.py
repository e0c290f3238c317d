"""Linear averaging and task arithmetic, each one weighted sum over the inputs.

Both are linear in the inputs, so each is computed as ``Σ c_j x_j`` with the
coefficients folded in Python first: one multiply and one fused multiply-add per input,
instead of forming task vectors and scaling them in separate passes over memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from maec_core.methods.base import TensorCall
from maec_core.methods.registry import register


def weighted_sum(tensors: Sequence[torch.Tensor], coeffs: Sequence[float]) -> torch.Tensor:
    """``Σ c_j x_j``, accumulated in place in ``tensors[0]`` (inputs belong to the call).

    No allocation: on the engine's per-slice path a fresh output per slice would cost
    page faults that outweigh the arithmetic.
    """
    out = tensors[0].mul_(coeffs[0])
    for t, c in zip(tensors[1:], coeffs[1:], strict=True):
        out.add_(t, alpha=c)
    return out


@register("linear", elementwise=True)
def linear(call: TensorCall) -> torch.Tensor:
    """Weighted average ``Σ w_i θ_i / Σ w_i`` (or the plain weighted sum if not normalize).

    Wortsman et al. 2022. The base model, when given, takes part like any other model.
    """
    tensors = ([call.base] if call.base is not None else []) + list(call.models)
    weights = ([1.0] if call.base is not None else []) + [p.weight for p in call.model_params]
    total = sum(weights)
    scale = 1.0 / total if call.params.normalize and total != 0 else 1.0
    return weighted_sum(tensors, [w * scale for w in weights])


@register("task_arithmetic", elementwise=True)
def task_arithmetic(call: TensorCall) -> torch.Tensor:
    """``θ0 + λ Σ w_i (θ_i − θ0)`` (Ilharco et al. 2023); normalize divides by ``Σ w_i``.

    Expanded to ``(1 − λ Σ w_i) θ0 + Σ λ w_i θ_i``: the same value, in one pass per input.
    """
    assert call.base is not None
    weights = [p.weight for p in call.model_params]
    total = sum(weights)
    scale = call.params.lambda_
    if call.params.normalize and total != 0:
        scale /= total
    coeffs = [1.0 - scale * total] + [scale * w for w in weights]
    return weighted_sum([call.base, *call.models], coeffs)
