"""NearSwap: take the other model's value where it is already close to the base's.

Per entry, with ``d = |θ1 − θ0|``: ``w = clamp(t / d, 0, 1)`` and the result is
``θ0 + w (θ1 − θ0)``: entries that differ by at most ``t`` are swapped outright, larger
differences move the base only by about ``t``. From alchemonaut's QuartetAnemoi merges
(huggingface.co/alchemonaut/QuartetAnemoi-70B-t0.0001); names as in mergekit 0.1.5, where
``t`` has no default either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from maec_core.methods.base import NoParams, Params, TensorCall, TensorMethod

if TYPE_CHECKING:
    import torch

# Differences below this count as this (mergekit's floor), so equal entries get w = 1
# instead of a division by zero.
_MIN_DIFF = 1e-6


class NearSwapParams(Params):
    t: float = Field(ge=0.0)


class NearSwap(TensorMethod):
    name = "nearswap"
    paper = ("alchemonaut 2024, NearSwap interpolation "
             "(huggingface.co/alchemonaut/QuartetAnemoi-70B-t0.0001)")
    params = NearSwapParams
    model_params = NoParams
    min_models = 1
    max_models = 1
    elementwise = True

    def merge(self, call: TensorCall) -> torch.Tensor:
        """``w · θ1 + (1 − w) · θ0`` with ``w = clamp(t / |θ1 − θ0|, 0, 1)``, entry by
        entry, in mergekit 0.1.5's order of operations (so its bytes come out; the
        rearranged ``θ0 + w · (θ1 − θ0)`` differed by a unit in the last place)."""
        import torch

        assert call.base is not None
        a, b = call.base, call.models[0]
        weight = (call.params.t / (a - b).abs_().clamp_(min=_MIN_DIFF)).clamp_(0.0, 1.0)
        return torch.add(weight * b, torch.rsub(weight, 1) * a)
