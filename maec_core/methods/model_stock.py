"""Model Stock (Jang et al. 2024, arXiv:2403.19522).

The fine-tunes' task vectors ``τ_i = θ_i − θ0`` are averaged and interpolated toward the
base by a ratio read off their geometry: with ``cos θ`` the mean pairwise cosine of the
task vectors and N their number, ``t = N cos θ / (1 + (N − 1) cos θ)`` and the result is
``θ0 + t · mean(τ_i)`` (the paper's ``t·w_avg + (1 − t)·w0``). Per tensor, or per output
row with ``filter_wise``. Parameter names and defaults follow mergekit 0.1.5.
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
    """Per row of the given 2-D task vectors: ``N cos / (1 + (N − 1) cos)``, 0 where
    the denominator vanishes. Sums in float64 (one row may be a whole tensor)."""
    import torch

    norms = [d.norm(dim=-1, dtype=torch.float64) for d in deltas]
    cos_sum = torch.zeros_like(norms[0])
    pairs = 0
    for i, a in enumerate(deltas):
        for j in range(i + 1, len(deltas)):
            dot = torch.sum(a * deltas[j], dim=-1, dtype=torch.float64)
            cos_sum += (dot / (norms[i] * norms[j]).clamp(min=_EPS)).clamp(-1.0, 1.0)
            pairs += 1
    cos = cos_sum / pairs
    n = len(deltas)
    denominator = 1 + (n - 1) * cos
    singular = denominator.abs() < _EPS
    ratio = n * cos / torch.where(singular, torch.ones_like(denominator), denominator)
    return ratio.masked_fill_(singular, 0.0)


class ModelStock(TensorMethod):
    name = "model_stock"
    paper = ("Jang et al. 2024, Model Stock: all we need is just a few fine-tuned models "
             "(arXiv:2403.19522)")
    params = ModelStockParams
    # No per-model parameters (as in mergekit): the ratio alone weighs the models.
    model_params = NoParams
    min_models = 2

    def merge(self, call: TensorCall) -> torch.Tensor:
        """``θ0 + t · mean(θ_i − θ0)`` with Model Stock's ratio t."""
        assert call.base is not None
        base = call.base
        width = base.shape[-1] if call.params.filter_wise and base.dim() >= 1 else -1
        rows = base.reshape(-1, width) if width != -1 else base.reshape(1, -1)
        deltas = [m.reshape(rows.shape).sub_(rows) for m in call.models]
        ratio = stock_ratio(deltas).to(base.dtype).unsqueeze(-1)
        mean = deltas[0]
        for d in deltas[1:]:
            mean.add_(d)
        mean.mul_(ratio / len(deltas))
        return mean.add_(rows).reshape(base.shape)
