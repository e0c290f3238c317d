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
        deltas.append(task_vector(t, p, i).mul_(w))
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
    with the call's ``normalize`` and ``lambda_``.

    Without ``elect`` the deltas are summed (divided by ``Σ w_i`` with normalize, unless
    the weights cancel out); with it they are combined as TIES steps 2 and 3
    (:func:`_elected_sum`).
    """
    assert call.base is not None
    normalize = call.params.normalize
    mixed = (_elected_sum(call.base, deltas, weights, normalize) if elect
             else _sum(deltas, weights, normalize))
    if call.params.lambda_ != 1.0:
        mixed.mul_(call.params.lambda_)
    return mixed.add_(call.base)


def _sum(deltas: Sequence[torch.Tensor], weights: Sequence[float], normalize: bool
         ) -> torch.Tensor:
    """``Σ d_i`` (divided by ``Σ w_i`` with normalize), accumulated in ``deltas[0]``."""
    mixed = deltas[0]
    for d in deltas[1:]:
        mixed.add_(d)
    total = sum(weights)
    if normalize and abs(total) > 1e-8:
        mixed.div_(total)
    return mixed


def _elected_sum(base: torch.Tensor, deltas: Sequence[torch.Tensor],
                 weights: Sequence[float], normalize: bool) -> torch.Tensor:
    """TIES steps 2 and 3: the sum of the deltas where they agree with the elected sign.

    The elected sign per entry is that of the summed weighted deltas (ties go to +);
    each delta contributes only where its sign agrees, and with ``normalize`` the sum is
    divided by the total weight of the agreeing models (1 where none agree).
    """
    import torch

    total = torch.zeros_like(base)
    for d in deltas:
        total.add_(d)
    positive = total >= 0
    del total
    mixed = torch.zeros_like(base)
    divisor = torch.zeros_like(base) if normalize else None
    for d, w in zip(deltas, weights, strict=True):
        # sign(d) == elected sign; zero (trimmed) entries never agree.
        agree = torch.where(positive, d > 0, d < 0)
        mixed.add_(d * agree)
        if divisor is not None:
            divisor.add_(agree, alpha=w)
    if divisor is not None:
        divisor.masked_fill_(divisor == 0, 1.0)
        mixed.div_(divisor)
    return mixed
