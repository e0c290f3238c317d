"""Task arithmetic (Ilharco et al. 2023, arXiv:2212.04089): ``θ0 + λ Σ w_i (θ_i − θ0)``.

Its global parameters are shared by the task-vector family (TIES, DARE, Breadcrumbs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from maec_core.methods._common import WeightParams, merge_deltas, weighted_deltas
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

        Op for op as mergekit 0.1.5, in the compute dtype: each delta times its weight,
        the weighted deltas summed, divided by the summed weights when normalising,
        times λ, added to the base. A recipe written for mergekit gives its bytes.
        16-bit merges take the task-vector sum TIES and DARE share; float32, the
        engine's streaming hot path, sums in place without its +0.0 start (below).
        """
        base = call.base
        assert base is not None
        if not call.models:
            return base
        if base.dtype.itemsize < 4:
            return merge_deltas(call, *weighted_deltas(call, lambda t, _p, _i: t.sub_(base)),
                                elect=False)
        return _in_place(call, [p.weight for p in call.model_params])


def _in_place(call: TensorCall, weights: list[float]) -> torch.Tensor:
    """The float32 (or float64) merge in the inputs' own buffers, the engine's streaming
    path: no allocation per slice, and one pass fewer than the shared sum.

    Summing in place in order is what torch's sum over the stacked deltas does in these
    dtypes, bit for bit, except that its sum starts at +0.0: a sum of negative zeros is
    +0.0 there and -0.0 here, which reaches the output only where the base is -0.0 and
    every weighted delta is -0.0. Matching that would cost a pass over every slice."""
    import torch

    base = call.base
    assert base is not None
    # The weights as mergekit holds them: in the compute dtype.
    held = torch.tensor(weights, dtype=base.dtype)
    mixed: torch.Tensor | None = None
    for m, w in zip(call.models, held.tolist(), strict=True):
        delta = m.sub_(base)
        if w != 1.0:  # times 1 is exact: a pass saved
            delta.mul_(w)
        mixed = delta if mixed is None else mixed.add_(delta)
    assert mixed is not None
    if call.params.normalize:
        divisor = float(held.sum())
        mixed.div_(1.0 if abs(divisor) < 1e-8 else divisor)
    if call.params.lambda_ != 1:
        mixed.mul_(call.params.lambda_)
    return mixed.add_(base)
