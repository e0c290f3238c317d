"""Arcee Fusion: take the other model's value only where the change matters most.

As mergekit 0.1.5 runs it (Arcee AI, arcee.ai). Each entry's importance is
``|θ1 − θ0|`` times the KL divergence ``KL(softmax(θ1) ‖ softmax(θ0))`` of its row
(softmax over the last dimension, ``1e-8`` added to both distributions); entries whose
importance reaches ``median + 1.5 · (Q3 − Q1)`` of the tensor's importances (Tukey's
upper fence) take the other model's value, the rest keep the base's.

Quantiles are the order statistics at ``⌊q · (n − 1)⌋``, as in mergekit, and exact for
every size: mergekit estimates them from a random sample of a million entries for larger
tensors, which would make the merge differ from run to run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from maec_core.methods.base import NoParams, TensorCall, TensorMethod

if TYPE_CHECKING:
    import torch

# Added to both softmax distributions so the logarithm of a vanishing probability stays
# finite (mergekit's constant).
_SMOOTH = 1e-8


def importance(other: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """``|θ1 − θ0| · KL(softmax(θ1) ‖ softmax(θ0))`` per entry (KL per row)."""
    import torch

    p = torch.softmax(other, dim=-1).add_(_SMOOTH)
    q = torch.softmax(base, dim=-1).add_(_SMOOTH)
    kl = (p * torch.log(p / q)).sum(dim=-1, keepdim=True)
    del p, q
    return (other - base).abs_().mul_(kl)


def upper_fence(scores: torch.Tensor) -> torch.Tensor:
    """``median + 1.5 · IQR`` of all the scores, from exact order statistics."""
    import torch

    flat = scores.reshape(-1)
    last = flat.numel() - 1
    q1, median, q3 = (torch.kthvalue(flat, int(q * last) + 1).values
                      for q in (0.25, 0.5, 0.75))
    return median + 1.5 * (q3 - q1)


class ArceeFusion(TensorMethod):
    name = "arcee_fusion"
    paper = "Arcee Fusion, Arcee AI (arcee.ai; as in mergekit 0.1.5)"
    params = NoParams
    model_params = NoParams
    min_models = 1
    max_models = 1
    # mergekit applies its mask as float32 (``θ0 + (θ1 − θ0) · mask``), so its result is
    # float32 whatever the compute dtype, and is saved so when the recipe names no
    # out_dtype.
    result_dtype = "float32"

    def merge(self, call: TensorCall) -> torch.Tensor:
        """``θ0 + (θ1 − θ0) · [importance ≥ upper fence]``, the mask in float32 as in
        mergekit: the difference is taken in the compute dtype and the sum in float32,
        which in 16 bits is not always ``θ1`` itself."""
        import torch

        assert call.base is not None
        other = call.models[0]
        scores = importance(other, call.base)
        take = (scores >= upper_fence(scores)).to(torch.float32)
        return call.base + (other - call.base) * take
