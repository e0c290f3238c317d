"""Pieces several methods share: per-model parameters and task-vector combination.

Tensor helpers take tensors and use their methods, so this module imports no torch at
import time (the API imports every module of the package).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import Field

from maec_core.methods.base import Finite, Params

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


def sum_deltas(
    base: torch.Tensor,
    deltas: Sequence[torch.Tensor],
    weights: Sequence[float],
    *,
    normalize: bool,
    lambda_: float,
) -> torch.Tensor:
    """``θ0 + λ Σ d_i`` over already weighted task vectors (divided by ``Σ w_i`` with
    normalize, unless the weights cancel out). Accumulates in ``deltas[0]``."""
    mixed = deltas[0]
    for d in deltas[1:]:
        mixed.add_(d)
    total = sum(weights)
    if normalize and abs(total) > 1e-8:
        mixed.div_(total)
    if lambda_ != 1.0:
        mixed.mul_(lambda_)
    return mixed.add_(base)


def elect_and_merge(
    base: torch.Tensor,
    deltas: Sequence[torch.Tensor],
    weights: Sequence[float],
    *,
    normalize: bool,
    lambda_: float,
) -> torch.Tensor:
    """TIES steps 2 and 3 on already weighted (and trimmed) task vectors.

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
    if lambda_ != 1.0:
        mixed.mul_(lambda_)
    return mixed.add_(base)
