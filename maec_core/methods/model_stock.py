"""Model Stock (Jang et al. 2024, arXiv:2403.19522).

The fine-tunes' task vectors ``τ_i = θ_i − θ0`` are averaged and interpolated toward the
base by a ratio read off their geometry: with ``cos θ`` the mean pairwise cosine of the
task vectors and N their number, ``t = N cos θ / (1 + (N − 1) cos θ)`` and the result is
the paper's ``t·w_avg + (1 − t)·w0`` (``θ0 + t · mean(τ_i)``, computed in that form as
mergekit computes it). Per tensor, or per output row with ``filter_wise``. Parameter
names, defaults and the order of operations follow mergekit 0.1.5.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from maec_core.methods.base import NoParams, Params, TensorCall, TensorMethod

if TYPE_CHECKING:
    import torch

# Below this the norm product or the ratio's denominator is treated as zero (mergekit's
# cut-offs): a zero task vector has no direction, and at the singularity the base is kept.
_EPS = 1e-6


class ModelStockParams(Params):
    # True: one ratio per row of the last dimension (per output filter) instead of one
    # per tensor.
    filter_wise: bool = False


def stock_ratio(deltas: list[torch.Tensor]) -> torch.Tensor:
    """Per row of the given task vectors (the last dimension): ``N cos / (1 + (N − 1)
    cos)``, 0 where the denominator vanishes, shaped ``[rows, 1]``.

    Computed in the task vectors' dtype, op for op as mergekit 0.1.5 does (the norms'
    product, then each pair's cosine, their mean), so a bfloat16 recipe gets mergekit's
    bfloat16 ratio: computing it in float64 moved a bf16 result by up to three units in
    the last place against mergekit's.
    """
    import torch

    cosines = []
    for i, a in enumerate(deltas):
        for b in deltas[i + 1:]:
            norms = torch.norm(a, dim=-1) * torch.norm(b, dim=-1)
            cosines.append(((a * b).sum(dim=-1) / norms.clamp(min=_EPS)).clamp(-1, 1))
    cos = torch.stack(cosines).mean(dim=0).unsqueeze(-1)
    n = len(deltas)
    denominator = 1 + (n - 1) * cos
    singular = denominator.abs() < _EPS
    safe = torch.where(singular, torch.ones_like(denominator), denominator)
    return torch.where(singular, torch.zeros_like(cos), (n * cos) / safe)


class ModelStock(TensorMethod):
    name = "model_stock"
    paper = ("Jang et al. 2024, Model Stock: all we need is just a few fine-tuned models "
             "(arXiv:2403.19522)")
    params = ModelStockParams
    # No per-model parameters (as in mergekit): the ratio alone weighs the models.
    model_params = NoParams
    min_models = 2

    def merge(self, call: TensorCall) -> torch.Tensor:
        """``t · mean(θ_i) + (1 − t) · θ0`` with Model Stock's ratio t (the paper's
        ``t·w_avg + (1 − t)·w0``), in mergekit's order of operations."""
        assert call.base is not None
        base = call.base
        width = base.shape[-1] if call.params.filter_wise and base.dim() >= 1 else -1
        rows = base.reshape(-1, width) if width != -1 else base.reshape(1, -1)
        models = [m.reshape(rows.shape) for m in call.models]
        ratio = stock_ratio([m - rows for m in models])
        average = models[0].clone()
        for m in models[1:]:
            average.add_(m)
        average.div_(len(models))
        return (ratio * average + (1 - ratio) * rows).reshape(base.shape)
