"""TIES-Merging: trim, elect sign, disjoint mean (Yadav et al. 2023, arXiv:2306.01708)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from maec_core.methods.base import TensorCall
from maec_core.methods.registry import register


def trim_magnitude_(delta: torch.Tensor, density: float) -> torch.Tensor:
    """Zero all but the ``density`` fraction of entries largest in magnitude, in place.

    At least one entry survives in a non-empty tensor. Entries tied with the k-th largest
    magnitude all survive: a threshold (not an index set) makes the result independent of
    sort stability and of the device, at the cost of keeping a few extra entries when
    low-precision inputs produce exact ties.
    """
    n = delta.numel()
    if density >= 1.0 or n == 0:
        return delta
    k = max(1, int(density * n))
    mags = delta.abs().reshape(-1)
    # The k-th largest is the (n - k + 1)-th smallest.
    threshold = torch.kthvalue(mags, n - k + 1).values
    return delta.masked_fill_((mags < threshold).reshape(delta.shape), 0.0)


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


@register("ties")
def ties(call: TensorCall) -> torch.Tensor:
    """``θ0 + λ · disjoint_mean(sign-elected, top-density w_i τ_i)``, ``τ_i = θ_i − θ0``."""
    assert call.base is not None
    deltas = []
    weights = []
    for t, p in zip(call.models, call.model_params, strict=True):
        d = trim_magnitude_(t - call.base, p.density)
        deltas.append(d.mul_(p.weight))
        weights.append(p.weight)
    return elect_and_merge(
        call.base, deltas, weights, normalize=call.params.normalize,
        lambda_=call.params.lambda_,
    )
