"""Spherical linear interpolation between the base and one other model, per tensor.

Shoemake 1985. Each tensor is treated as one flat vector: the angle θ between the two
(normalised) vectors gives ``sin((1−t)θ)/sin θ · v0 + sin(tθ)/sin θ · v1`` on the
unnormalised vectors. Nearly (anti)parallel pairs, where sin θ → 0, fall back to linear
interpolation; a tensor whose norm is below ``eps`` counts as orthogonal to the other
(mergekit's rule).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import Field

from maec_core.methods.base import NoParams, Params, TensorCall, TensorMethod

if TYPE_CHECKING:
    import torch

# |cos θ| above this means the vectors are (anti)parallel within float32 noise; the same
# cut-off mergekit uses, so recipes behave alike.
DOT_THRESHOLD = 0.9995


# Float64 sums run over chunks of this many entries, so the upcast copy stays small.
_CHUNK = 1 << 22


def lerp(v0: torch.Tensor, v1: torch.Tensor, t: float) -> torch.Tensor:
    return v0.lerp(v1, t)


def dot64(a: torch.Tensor, b: torch.Tensor) -> float:
    """``a · b`` of two flat float tensors, accumulated in float64."""
    total = 0.0
    for i in range(0, a.numel(), _CHUNK):
        total += float(a[i:i + _CHUNK].double().dot(b[i:i + _CHUNK].double()))
    return total


class SlerpParams(Params):
    t: float = Field(0.5, ge=0.0, le=1.0)
    eps: float = Field(1e-8, gt=0.0)


class Slerp(TensorMethod):
    name = "slerp"
    paper = "Shoemake 1985 spherical interpolation, as used for LLM merges"
    params = SlerpParams
    model_params = NoParams
    min_models = 1
    max_models = 1

    def merge(self, call: TensorCall) -> torch.Tensor:
        """SLERP from ``base`` (t = 0) to the single other model (t = 1)."""
        assert call.base is not None
        v0, v1 = call.base, call.models[0]
        t = float(call.params.t)
        eps = float(call.params.eps)
        a, b = v0.reshape(-1), v1.reshape(-1)
        # Norms and the dot in float64: one sum over billions of entries in float32 loses
        # digits that the angle of two nearly parallel fine-tunes depends on.
        n0 = math.sqrt(dot64(a, a))
        n1 = math.sqrt(dot64(b, b))
        # A vector of norm below eps counts as orthogonal to the other (cos θ = 0, so
        # θ = π/2), not as parallel: mergekit 0.1.5's rule, so a bias that is zero in
        # the base (GPT-2, Qwen2, Phi) merges to sin(tπ/2)·v1 in both tools.
        tiny = n0 < eps or n1 < eps
        dot = 0.0 if tiny else max(-1.0, min(1.0, dot64(a, b) / (n0 * n1)))
        if abs(dot) > DOT_THRESHOLD:
            return lerp(v0, v1, t)
        theta = math.acos(dot)
        s = math.sin(theta)
        c0 = math.sin((1.0 - t) * theta) / s
        c1 = math.sin(t * theta) / s
        return v0.mul(c0).add_(v1, alpha=c1)
