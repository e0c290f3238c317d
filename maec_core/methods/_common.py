"""Pieces several methods share: per-model parameters and task-vector combination.

Tensor helpers take tensors and use their methods, so this module imports no torch at
import time (the API imports every module of the package).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import Field

from maec_core.methods.base import Finite, Params, TensorCall

if TYPE_CHECKING:
    import torch


class WeightParams(Params):
    weight: Finite = 1.0


class DensityParams(WeightParams):
    density: Finite = Field(1.0, gt=0.0, le=1.0)


def weighted_sum(tensors: Sequence[torch.Tensor], coeffs: Sequence[float]) -> torch.Tensor:
    """``Σ c_j x_j``, accumulated in place in ``tensors[0]`` (inputs belong to the call).

    No allocation: on the engine's per-slice path a fresh output per slice would cost
    page faults that outweigh the arithmetic.
    """
    out = tensors[0].mul_(coeffs[0])
    for t, c in zip(tensors[1:], coeffs[1:], strict=True):
        out.add_(t, alpha=c)
    return out


def weighted_deltas(
    call: TensorCall, task_vector: Callable[[torch.Tensor, Any, int], torch.Tensor]
) -> tuple[list[torch.Tensor], list[float]]:
    """Each model's task vector, ``task_vector(θ_i, its parameters, i)`` (sparsified as
    the method does), multiplied in place by its weight; and the weights."""
    deltas, weights = [], []
    for i, (t, p) in enumerate(zip(call.models, call.model_params, strict=True)):
        w = in_compute_dtype(p.weight, t)
        delta = task_vector(t, p, i)
        if w != 1.0:  # times 1 is exact: a pass saved
            delta.mul_(w)
        deltas.append(delta)
        weights.append(w)
    return deltas, weights


def in_compute_dtype(value: float, like: torch.Tensor) -> float:
    """``value`` rounded to ``like``'s dtype when that is a 16-bit one: mergekit holds a
    merge's weights in its compute dtype, so a bf16 TIES weighs by bf16(0.6) =
    0.6015625, and so must this, to give its bytes (float32 keeps the value as given)."""
    import torch

    if like.dtype in (torch.bfloat16, torch.float16):
        return float(torch.tensor(value, dtype=like.dtype))
    return value


def merge_deltas(
    call: TensorCall,
    deltas: Sequence[torch.Tensor],
    weights: Sequence[float],
    *,
    elect: bool,
) -> torch.Tensor:
    """``θ0 + λ · combined(d_i)`` over already weighted (and sparsified) task vectors,
    with the call's ``normalize`` and ``lambda_``, op for op as mergekit 0.1.5 in the
    compute dtype.

    Without ``elect`` the deltas are summed (divided by ``Σ w_i`` with normalize, unless
    the weights cancel out); with it they are combined as TIES steps 2 and 3: each
    delta counts only where its sign agrees with the sign of the deltas' sum (ties go
    to +), divided with normalize by the total weight of the agreeing models (1 where
    none agree).
    """
    import torch

    base = call.base
    assert base is not None
    held = torch.tensor(list(weights), dtype=base.dtype, device=base.device)
    if elect:
        positive = _total(deltas, keep=True) >= 0
        # sign(d) == elected sign; zero (trimmed) entries never agree.
        agree = [torch.where(positive, d > 0, d < 0) for d in deltas]
        mixed = _total([d.mul_(a) for d, a in zip(deltas, agree, strict=True)])
        divisor = _total([a * w for a, w in zip(agree, held, strict=True)])
        divisor[divisor == 0] = 1
    else:
        mixed = _total(deltas)
        divisor = held.sum()
        divisor[divisor.abs() < 1e-8] = 1
    if call.params.normalize:
        mixed /= divisor
    if call.params.lambda_ != 1.0:
        mixed *= call.params.lambda_
    return mixed.add_(base)


def _total(tensors: Sequence[torch.Tensor], keep: bool = False) -> torch.Tensor:
    """``Σ t_i`` as torch sums the stacked tensors over their first axis. In float32 and
    float64 that is the sum in order from +0.0 (so -0.0 terms sum to +0.0), done without
    the stacked copy, in ``tensors[0]`` unless ``keep`` (then in a new tensor); a 16-bit
    sum accumulates in float32 and rounds once, so those are stacked (a new tensor)."""
    import torch

    if tensors[0].dtype.itemsize < 4:
        return torch.stack(list(tensors)).sum(dim=0)
    # 0 + t_0, as torch's sum starts: t_0 itself but for -0.0, which becomes +0.0.
    out = tensors[0].add(0.0) if keep else tensors[0].add_(0.0)
    for t in tensors[1:]:
        out.add_(t)
    return out
