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

import threading
from collections.abc import Sequence
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
        if call.reduced is not None:  # a slice: the first passes found the coefficients
            return interpolate(call, call.reduced)
        return slerp(call.base, call.models[0], float(call.params.t), float(call.params.eps))

    def first_pass(self, call: TensorCall, compute: torch.dtype) -> SlerpPass:
        """The norms and the dot, reduced over slices in mergekit's chunks."""
        return SlerpPass(compute, float(call.params.t), float(call.params.eps))


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
        .sum(dim=1, keepdim=True) for i in chunks]).sum(dim=0)
    coef_a, coef_b = coefficients(dot, tt)
    out = torch.empty_like(a)
    for i in chunks:
        x, y = a[:, i:i + step].to(dtype), b[:, i:i + step].to(dtype)
        out[:, i:i + step] = coef_a * x + coef_b * y
    return out.reshape(v0.shape)


def coefficients(dot: torch.Tensor, tt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights of ``v0`` and ``v1`` from the summed dot of the normalised vectors
    (before clamping) and ``t`` (as mergekit holds it: a float32 tensor)."""
    import torch

    dot = dot.clamp(-1, 1)
    linear = dot.abs() > DOT_THRESHOLD
    theta = torch.acos(torch.where(linear, 0, dot))
    sin_theta = torch.sin(theta)
    coef_a = torch.where(linear, 1 - tt, torch.sin((1 - tt) * theta) / sin_theta)
    coef_b = torch.where(linear, tt, torch.sin(tt * theta) / sin_theta)
    return coef_a, coef_b


_SCRATCH = threading.local()


def _chunk_buffers() -> list[torch.Tensor]:
    """Two float32 buffers of one mergekit chunk, this thread's own. The engine runs a
    tensor's pass on one thread from its first slice to :meth:`SlerpPass.finish` before
    the next tensor's, so the passes share them: one allocation instead of 8 MB freed
    and taken again per tensor and pass (which left the allocator's heap fragmented,
    tens of MB above the buffers themselves)."""
    import torch

    bufs: list[torch.Tensor] | None = getattr(_SCRATCH, "bufs", None)
    if bufs is None or bufs[0].numel() != _MERGEKIT_CHUNK:
        bufs = [torch.empty(_MERGEKIT_CHUNK, dtype=torch.float32) for _ in range(2)]
        _SCRATCH.bufs = bufs
    return bufs


class SlerpPass:
    """SLERP's reductions over flat slices (stored dtype), for the engine's 16-bit
    stream: mergekit's norms and dot are sums over its chunks of ``_MERGEKIT_CHUNK``
    entries, so each chunk is gathered (a float32 buffer of one chunk per input) and
    reduced as the whole-tensor path reduces it. Two passes: the norms, then the dot of
    the normalised chunks (which divides by the norms). The state is the coefficients;
    each slice is then ``coef_a · v0 + coef_b · v1`` in float32, entry by entry.
    """

    def __init__(self, compute: torch.dtype, t: float, eps: float) -> None:
        import torch

        self.compute, self.eps = compute, eps
        self.tt = torch.tensor([[t]], dtype=torch.float32)
        self.bufs: list[torch.Tensor] = []
        self.filled = 0
        self.parts: list[list[torch.Tensor]] = [[], []]
        self.dots: list[torch.Tensor] = []
        self.norms: list[torch.Tensor] | None = None
        self.state: tuple[torch.Tensor, torch.Tensor] | None = None

    def add(self, base: torch.Tensor | None, models: Sequence[torch.Tensor]) -> None:

        assert base is not None
        pair = (base, models[0])
        if not self.bufs:
            self.bufs = _chunk_buffers()
        done = 0
        while done < base.numel():
            take = min(base.numel() - done, _MERGEKIT_CHUNK - self.filled)
            for buf, x in zip(self.bufs, pair, strict=True):
                # The compute dtype first: the whole-tensor path's inputs are in it.
                buf[self.filled:self.filled + take].copy_(
                    x[done:done + take].to(self.compute))
            self.filled += take
            done += take
            if self.filled == _MERGEKIT_CHUNK:
                self._reduce_chunk()

    def _reduce_chunk(self) -> None:
        import torch

        a, b = (buf[:self.filled].reshape(1, -1) for buf in self.bufs)
        if self.norms is None:
            for parts, x in zip(self.parts, (a, b), strict=True):
                parts.append(torch.linalg.vector_norm(x, dim=1, keepdim=True))
        else:
            # In place, in the whole-tensor path's order: (a / n0) * (b / n1).
            a.div_(self.norms[0])
            self.dots.append(a.mul_(b.div_(self.norms[1])).sum(dim=1, keepdim=True))
        self.filled = 0

    def again(self) -> bool:
        """Whether the slices must be passed once more (the dot, after the norms)."""
        return self.state is None and self.norms is not None

    def finish(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        import torch

        if self.filled:
            self._reduce_chunk()
        # The buffers go back to the next tensor's pass.
        self.bufs = []
        if self.norms is None:
            if not self.parts[0]:
                return None  # no entries: the whole-tensor path's own case
            norms = [torch.linalg.vector_norm(torch.stack(p), dim=0) for p in self.parts]
            self.norms = [torch.where(n > self.eps, n, 1) for n in norms]
            return None
        self.state = coefficients(torch.stack(self.dots).sum(dim=0), self.tt)
        return self.state


def interpolate(call: TensorCall, coefs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A flat slice of SLERP's result from its coefficients (float32, entry by entry,
    as the whole-tensor path's last step)."""
    import torch

    assert call.base is not None
    a, b = (x.reshape(1, -1).to(torch.float32) for x in (call.base, call.models[0]))
    # In the compute dtype, as the whole-tensor path's output buffer holds it.
    return (coefs[0] * a + coefs[1] * b).reshape(call.base.shape).to(call.base.dtype)
