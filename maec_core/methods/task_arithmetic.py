"""Task arithmetic (Ilharco et al. 2023, arXiv:2212.04089): ``θ0 + λ Σ w_i (θ_i − θ0)``.

Its global parameters are shared by the task-vector family (TIES, DARE, Breadcrumbs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from maec_core.methods._common import WeightParams, weighted_sum
from maec_core.methods.base import Params, TensorCall, TensorMethod

if TYPE_CHECKING:
    import torch


class TaskArithmeticParams(Params):
    normalize: bool = False
    lambda_: float = Field(1.0, alias="lambda")
    # Accepted so mergekit recipes run unchanged; masks are a GPU-memory trick there and
    # have no effect on results here.
    int8_mask: bool = False
    # True: a sparsified task vector is scaled back to the L1 norm it had before (for the
    # methods that sparsify; task arithmetic itself keeps every entry, so it is a no-op).
    rescale: bool = False


class TaskArithmeticModelParams(WeightParams):
    # Accepted, with mergekit's default, and ignored as there: task arithmetic keeps
    # every entry, so a recipe written for the sparsifying methods runs unchanged.
    density: float = 1.0


class TaskArithmetic(TensorMethod):
    name = "task_arithmetic"
    paper = "Ilharco et al. 2023, Editing models with task arithmetic (arXiv:2212.04089)"
    params = TaskArithmeticParams
    model_params = TaskArithmeticModelParams
    elementwise = True

    def merge(self, call: TensorCall) -> torch.Tensor:
        """``θ0 + λ Σ w_i (θ_i − θ0)``; normalize divides by ``Σ w_i``.

        Expanded to ``(1 − λ Σ w_i) θ0 + Σ λ w_i θ_i``: the same value, in one pass per
        input.
        """
        assert call.base is not None
        weights = [p.weight for p in call.model_params]
        if call.base.dtype.itemsize < 4:
            return _as_mergekit(call, weights)
        total = sum(weights)
        scale = call.params.lambda_
        if call.params.normalize and total != 0:
            scale /= total
        coeffs = [1.0 - scale * total] + [scale * w for w in weights]
        return weighted_sum([call.base, *call.models], coeffs)


def _as_mergekit(call: TensorCall, weights: list[float]) -> torch.Tensor:
    """A 16-bit merge op for op as mergekit 0.1.5 computes it, so its bytes come out:
    the weighted deltas summed in the compute dtype, divided by the summed weights when
    normalising, times λ, added to the base. (The float32 path folds the coefficients
    into one weighted sum for speed; in 16 bits that differed by a unit in the last
    place.)"""
    import torch

    assert call.base is not None
    base = call.base
    deltas = torch.stack([m - base for m in call.models])
    w = torch.tensor(weights, dtype=deltas.dtype, device=deltas.device)
    w = w.reshape(-1, *([1] * base.dim()))
    mixed = deltas.mul_(w).sum(dim=0)
    if call.params.normalize:
        divisor = w.sum(dim=0)
        divisor[divisor.abs() < 1e-8] = 1
        mixed /= divisor
    if call.params.lambda_ != 1:
        mixed *= call.params.lambda_
    return base + mixed
