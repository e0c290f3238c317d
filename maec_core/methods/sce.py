"""SCE: select, calculate, erase (Wan et al. 2024, FuseChat, arXiv:2408.07990).

Task vectors ``τ_i = θ_i − θ0`` are (1) restricted to the ``select_topk`` fraction of
entries where they vary most across the models, (2) weighted per model by their mean
squared entry, normalised to sum to one, and (3) sign-elected: each entry averages, with
those weights, only the task vectors whose sign agrees with the sign of their sum.
Parameter names, defaults and cut-offs follow mergekit 0.1.5; the method has no
per-model parameters there either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from maec_core.methods.base import NoParams, Params, TensorCall, TensorMethod

if TYPE_CHECKING:
    import torch

# Below this the summed model weights count as zero and the models weigh equally, and
# the per-entry divisor is floored at it (mergekit's cut-offs, kept so recipes agree).
_EPS = 1e-6


class SceParams(Params):
    # Fraction of the entries with non-zero variance across the task vectors that are
    # kept (the highest-variance ones); 1 or more keeps all, 0 or less none.
    select_topk: float = 1.0
    # Accepted so mergekit recipes run unchanged; a GPU-memory trick there, no effect here.
    int8_mask: bool = False


def select_mask(deltas: list[torch.Tensor], fraction: float) -> torch.Tensor:
    """Entries whose variance over the models (population variance, in the task
    vectors' dtype, as mergekit 0.1.5 computes it) is among the ``fraction`` highest:
    ``int(fraction · #non-zero variances)`` of them.

    A variance threshold decides when it selects exactly that many; when variances tied
    with it make it select more, the entries are those mergekit's top-k picks
    (:func:`mergekit_topk`).
    """
    import torch

    var = torch.var(torch.stack(deltas), dim=0, unbiased=False)
    k = int(int(torch.count_nonzero(var)) * fraction) if fraction > 0 else 0
    if k == 0:
        return torch.zeros_like(var, dtype=torch.bool)
    flat = var.reshape(-1)
    threshold = torch.kthvalue(flat.float(), flat.numel() - k + 1).values
    mask = var >= threshold
    if int(mask.sum()) == k:
        return mask
    keep = torch.zeros(flat.numel(), dtype=torch.bool, device=var.device)
    keep[mergekit_topk(flat, k)] = True
    return keep.reshape(var.shape)


def mergekit_topk(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest of a flat tensor, ties broken as mergekit 0.1.5's
    ``torch.topk`` breaks them on the CPU (not by position: as with its sorts, the
    choice among tied values depends on the whole tensor), computed on the CPU in the
    values' own dtype (as there) so every device gets the same set."""
    import torch

    key = values.detach().to(device="cpu")
    return torch.topk(key.abs(), k, largest=True).indices.to(values.device)


def model_weights(deltas: torch.Tensor) -> torch.Tensor:
    """Each task vector's mean squared entry (rows of the stacked ``deltas``),
    normalised to sum to one (equal weights when they sum to less than the cut-off), in
    the task vectors' dtype as mergekit computes them."""
    import torch

    weights = deltas.square().reshape(deltas.shape[0], -1).mean(dim=1)
    total = float(torch.sum(weights))
    if abs(total) < _EPS:
        return torch.ones_like(weights) / weights.shape[0]
    return weights / total


class Sce(TensorMethod):
    name = "sce"
    paper = "Wan et al. 2024, FuseChat: knowledge fusion of chat models (arXiv:2408.07990)"
    params = SceParams
    model_params = NoParams

    def merge(self, call: TensorCall) -> torch.Tensor:
        """``θ0 + Σ_i w_i a_i τ_i / max(Σ_i w_i a_i, 1e-6)``, ``a_i`` the sign agreement.

        In the compute dtype and mergekit's order of operations (a float16 recipe gets
        mergekit's float16 selection and weights: float64 weights moved its result)."""
        import torch

        assert call.base is not None
        base = call.base
        deltas = torch.stack(list(call.models)).sub_(base)
        if call.params.select_topk < 1.0:
            deltas.mul_(select_mask(list(deltas), call.params.select_topk))
        # Zero entries agree with neither sign (mergekit's sign comparison).
        majority = torch.where(deltas.sum(dim=0) >= 0, 1, -1).to(deltas.dtype)
        agree = deltas.sign() == majority
        weights = model_weights(deltas).reshape(-1, *([1] * (deltas.dim() - 1)))
        erased = weights * agree
        merged = (deltas * erased).sum(dim=0)
        return base + merged / erased.sum(dim=0).clamp(min=_EPS)
