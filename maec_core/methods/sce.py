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
    """Entries whose variance over the models is among the ``fraction`` highest.

    ``int(fraction · #non-zero variances)`` entries are selected. A variance threshold
    decides when it selects exactly that many; when variances tied with it make it
    select more, the entries are those mergekit's top-k picks (:func:`mergekit_topk`).
    """
    import torch

    n = len(deltas)
    mean = torch.zeros_like(deltas[0])
    for d in deltas:
        mean.add_(d, alpha=1.0 / n)
    var = torch.zeros_like(mean)
    for d in deltas:
        var.addcmul_(d - mean, d - mean, value=1.0 / n)
    del mean
    k = int(int(torch.count_nonzero(var)) * fraction) if fraction > 0 else 0
    if k == 0:
        return torch.zeros_like(var, dtype=torch.bool)
    flat = var.reshape(-1)
    threshold = torch.kthvalue(flat, flat.numel() - k + 1).values
    mask = var >= threshold
    if int(mask.sum()) == k:
        return mask
    keep = torch.zeros(flat.numel(), dtype=torch.bool, device=var.device)
    keep[mergekit_topk(flat, k)] = True
    return keep.reshape(var.shape)


def mergekit_topk(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest of a flat tensor, ties broken as mergekit 0.1.5's
    ``torch.topk`` breaks them on the CPU (not by position: as with its sorts, the
    choice among tied values depends on the whole tensor), computed on the CPU in
    float32 so every device gets the same set."""
    import torch

    key = values.detach().to(device="cpu", dtype=torch.float32)
    return torch.topk(key, k, largest=True).indices.to(values.device)


def model_weights(deltas: list[torch.Tensor]) -> list[float]:
    """Each task vector's mean squared entry, normalised to sum to one (equal weights
    when they sum to less than the cut-off)."""
    import torch

    raw = [float(d.square().mean(dtype=torch.float64)) for d in deltas]
    total = sum(raw)
    if abs(total) < _EPS:
        return [1.0 / len(deltas)] * len(deltas)
    return [w / total for w in raw]


class Sce(TensorMethod):
    name = "sce"
    paper = "Wan et al. 2024, FuseChat: knowledge fusion of chat models (arXiv:2408.07990)"
    params = SceParams
    model_params = NoParams

    def merge(self, call: TensorCall) -> torch.Tensor:
        """``θ0 + Σ_i w_i a_i τ_i / max(Σ_i w_i a_i, 1e-6)``, ``a_i`` the sign agreement."""
        import torch

        assert call.base is not None
        deltas = [m.sub_(call.base) for m in call.models]
        if call.params.select_topk < 1.0:
            keep = select_mask(deltas, call.params.select_topk)
            for d in deltas:
                d.mul_(keep)
            del keep
        weights = model_weights(deltas)
        total = torch.zeros_like(call.base)
        for d in deltas:
            total.add_(d)
        positive = total >= 0
        mixed, divisor = total.zero_(), torch.zeros_like(call.base)
        for d, w in zip(deltas, weights, strict=True):
            # Zero entries agree with neither sign (mergekit's sign comparison).
            agree = torch.where(positive, d > 0, d < 0)
            mixed.add_(d.mul_(agree), alpha=w)
            divisor.add_(agree, alpha=w)
        return mixed.div_(divisor.clamp_(min=_EPS)).add_(call.base)
