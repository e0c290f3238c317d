"""DARE: drop and rescale task vectors, then add them linearly.

Yu et al. 2024, "Language Models are Super Mario" (arXiv:2311.03099). Each entry of each
task vector survives with probability ``density`` (= 1 − p) and survivors are scaled by
1/density, which keeps the expected task vector unchanged.

Reproducibility: one CPU ``torch.Generator`` per tensor, seeded with the crc32 of
``random_seed`` and the tensor name, draws the masks of the models in recipe order. The masks
thus depend only on the recipe and the tensor's name, not on the device, on the order in
which tensors are processed or on which other tensors exist.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from pydantic import Field

from maec_core.methods._common import DensityParams, merge_deltas, weighted_deltas
from maec_core.methods._sparsify import drop_and_rescale_, tensor_generator
from maec_core.methods.base import TensorCall, TensorMethod
from maec_core.methods.task_arithmetic import TaskArithmeticParams

if TYPE_CHECKING:
    import torch


class DareParams(TaskArithmeticParams):
    # mergekit 0.1.5 defaults for dare_linear and dare_ties: no normalisation, rescale on.
    normalize: bool = False
    # True: survivors are scaled by 1/density, as in Yu et al. 2024 (mergekit instead
    # matches the L1 norm of the dropped delta); False: no rescaling.
    rescale: bool = True
    random_seed: int = Field(0, ge=0)


def dropped_deltas(call: TensorCall) -> tuple[list[torch.Tensor], list[float]]:
    """The calls' weighted task vectors after DARE's drop (and rescale)."""
    base = call.base
    assert base is not None
    gen = tensor_generator(call.params.random_seed, call.name)

    def dropped(t: torch.Tensor, p: DensityParams, _i: int) -> torch.Tensor:
        return drop_and_rescale_(t - base, p.density, gen, rescale=call.params.rescale)

    return weighted_deltas(call, dropped)


class DareLinear(TensorMethod):
    name = "dare_linear"
    paper = "Yu et al. 2024, Language models are Super Mario (arXiv:2311.03099)"
    params = DareParams
    model_params = DensityParams
    # Off: the task vectors are added; on: TIES sign election and disjoint mean.
    elect: ClassVar[bool] = False

    def merge(self, call: TensorCall) -> torch.Tensor:
        """``θ0 + λ Σ w_i DARE(τ_i)`` (divided by ``Σ w_i`` with normalize)."""
        return merge_deltas(call, *dropped_deltas(call), elect=self.elect)
