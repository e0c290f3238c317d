"""Spherical linear interpolation between the base and one other model, per tensor.

Shoemake 1985. Each tensor is treated as one flat vector: the angle θ between the two
(normalised) vectors gives ``sin((1−t)θ)/sin θ · v0 + sin(tθ)/sin θ · v1`` on the
unnormalised vectors. Nearly (anti)parallel pairs, where sin θ → 0, fall back to linear
interpolation; a tensor whose norm is below ``eps`` counts as orthogonal to the other
(mergekit's rule). Computed op for op as mergekit 0.1.5 computes it (float32 chunked
norms and dot), so a recipe gives mergekit's bytes; float64 sums here had differed from
it by a unit in the last place.
"""

from __future__ import annotations

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
        return slerp(call.base, call.models[0], float(call.params.t), float(call.params.eps))


# mergekit 0.1.5 sums norms and the dot over chunks of this many entries.
_MERGEKIT_CHUNK = 1024 * 1024


def slerp(v0: torch.Tensor, v1: torch.Tensor, t: float, eps: float) -> torch.Tensor:
    """SLERP of two tensors as mergekit 0.1.5 computes it, so its bytes come out: in
    float32 (float64 for float64 inputs), the norms as norms of per-chunk norms, the dot
    of the normalised chunks summed over chunks, the coefficients as float32 tensors.
    A vector of norm below ``eps`` is left unnormalised (its dot is then about 0: it
    counts as orthogonal to the other, so a bias that is zero in the base merges to
    sin(tπ/2)·v1). Pairs with |cos θ| above DOT_THRESHOLD are interpolated linearly."""
    import torch

    dtype = torch.float64 if v0.dtype == torch.float64 else torch.float32
    a, b = v0.reshape(1, -1), v1.reshape(1, -1)
    tt = torch.tensor([[t]], dtype=dtype, device=v0.device)
    if not a.shape[1]:
        return ((1 - tt) * a + tt * b).reshape(v0.shape).to(v0.dtype)
    step = _MERGEKIT_CHUNK
    chunks = range(0, a.shape[1], step)
    norms = []
    for x in (a, b):
        parts = torch.stack([torch.linalg.vector_norm(x[:, i:i + step].to(dtype), dim=1,
                                                      keepdim=True) for i in chunks])
        norm = torch.linalg.vector_norm(parts, dim=0)
        norms.append(torch.where(norm > eps, norm, 1))
    dot = torch.stack([
        (a[:, i:i + step].to(dtype) / norms[0] * (b[:, i:i + step].to(dtype) / norms[1]))
        .sum(dim=1, keepdim=True) for i in chunks]).sum(dim=0).clamp(-1, 1)
    linear = dot.abs() > DOT_THRESHOLD
    theta = torch.acos(torch.where(linear, 0, dot))
    sin_theta = torch.sin(theta)
    coef_a = torch.where(linear, 1 - tt, torch.sin((1 - tt) * theta) / sin_theta)
    coef_b = torch.where(linear, tt, torch.sin(tt * theta) / sin_theta)
    out = torch.empty_like(a)
    for i in chunks:
        x, y = a[:, i:i + step].to(dtype), b[:, i:i + step].to(dtype)
        out[:, i:i + step] = coef_a * x + coef_b * y
    return out.reshape(v0.shape)
