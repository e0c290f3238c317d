"""RAM and RAM+ (tensor-local): task vectors merged by how many models change each entry.

Reinforced Agent Merging (arXiv:2601.13572). An entry of model ``i``'s task vector
``τ_i = θ_i − θ0`` *contributes* when ``|τ_i| > ε``; ``c`` counts the contributing
models per entry. RAM keeps an entry only one model changes as it is and averages the
others over their contributors: ``θ0 + Σ_i z_i / max(c, 1)`` with ``z_i = τ_i`` where
it contributes, else 0. RAM+ (tensor-local) scales each model's unique entries by
``λ_i = 1 + r · clamp(ρ_i, 0, α)``, ``ρ_i`` the model's count of shared entries over its
count of unique ones in this tensor (at least ε). Names and defaults as in mergekit
0.1.5, and its order of operations, so float32 results agree bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from maec_core.methods.base import Finite, NoParams, Params, TensorCall, TensorMethod

if TYPE_CHECKING:
    import torch


class RamParams(Params):
    epsilon: Finite = Field(1e-5, ge=0.0)


class RamPlusParams(RamParams):
    r: Finite = 0.1
    alpha: Finite = 0.2


def _contributions(call: TensorCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the task vectors stacked and flattened, which entries contribute, the
    contributor count c per entry with a leading axis of 1)."""
    import torch

    assert call.base is not None
    deltas = torch.stack([m - call.base for m in call.models]).reshape(len(call.models), -1)
    nonzero = deltas.abs() > call.params.epsilon
    return deltas, nonzero, nonzero.sum(dim=0, keepdim=True)


def _merged(call: TensorCall, scale: torch.Tensor | None) -> torch.Tensor:
    """``θ0 + Σ_i (z_i [c = 1] λ_i + z_i [c > 1] / max(c, 1))`` (λ_i = 1 without scale)."""
    assert call.base is not None
    deltas, nonzero, counts = _contributions(call)
    z = deltas * nonzero
    del deltas, nonzero
    overlap, unique = counts > 1, counts == 1
    own = z * unique if scale is None else z * unique * scale.unsqueeze(-1)
    merged = (own + z * overlap / counts.clamp(min=1)).sum(dim=0, keepdim=True)
    return call.base + merged.reshape_as(call.base)


class Ram(TensorMethod):
    name = "ram"
    paper = "Reinforced Agent Merging (arXiv:2601.13572)"
    params = RamParams
    model_params = NoParams
    min_models = 1
    elementwise = True

    def merge(self, call: TensorCall) -> torch.Tensor:
        """``θ0 + Σ_i z_i / max(c, 1)`` (an entry one model changes kept as it is)."""
        return _merged(call, None)


class RamPlusTensorLocal(TensorMethod):
    name = "ramplus_tl"
    paper = "Reinforced Agent Merging Plus, tensor-local (arXiv:2601.13572)"
    params = RamPlusParams
    model_params = NoParams
    min_models = 1
    # λ_i is float32 (a count over a count), so mergekit's result is float32 whatever
    # the compute dtype, and is saved so when the recipe names no out_dtype.
    result_dtype = "float32"

    def merge(self, call: TensorCall) -> torch.Tensor:
        """RAM with each model's unique entries scaled by ``λ_i`` (counted per tensor)."""
        _, nonzero, counts = _contributions(call)
        shared = (nonzero & (counts > 1)).sum(dim=1)
        unique = (nonzero & (counts == 1)).sum(dim=1)
        rho = shared / unique.clamp(min=call.params.epsilon)
        lam = 1 + call.params.r * rho.clamp(min=0, max=call.params.alpha)
        return _merged(call, lam)
