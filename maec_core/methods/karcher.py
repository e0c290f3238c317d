"""Karcher mean: the Riemannian barycentre of the models' directions on the hypersphere.

As mergekit 0.1.5 runs it: every input (the base too, when given: it is one more model
here, not an origin) is one flat vector ``x_i`` with norm ``n_i``; the directions
``u_i = x_i / n_i`` of the inputs longer than ``tol`` get equal weights, and their
Karcher mean ``m`` on the unit sphere is found by fixed-point iteration from their
normalised Euclidean mean (at most ``max_iter`` steps, stopping when the step is below
``tol``). The result is ``m`` times the mean of all the inputs' norms.
Reference: Karcher 1977, Riemannian center of mass and mollifier smoothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import Field

from maec_core.methods.base import NoParams, Params, TensorCall, TensorMethod

if TYPE_CHECKING:
    import torch


class KarcherParams(Params):
    max_iter: int = Field(10, ge=0)
    # Norms, angles and steps below this count as zero.
    tol: float = Field(1e-5, ge=0.0)


def _norm(x: torch.Tensor) -> torch.Tensor:
    """``‖x‖`` as a 0-d tensor in float32 (float64 for float64 inputs), as mergekit takes
    it: the accumulation is wider than a 16-bit compute dtype."""
    import torch

    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    norm: torch.Tensor = torch.linalg.vector_norm(x.to(wide))
    return norm


def _tangent(mean: torch.Tensor, units: Sequence[torch.Tensor], alphas: Sequence[float],
             tol: float) -> torch.Tensor:
    """``Σ α_i log_m(u_i)``: the weighted mean of the directions' log maps at ``mean``,
    each term in the compute dtype as mergekit forms it."""
    import torch

    step = torch.zeros_like(mean)
    flat = mean.flatten()
    for alpha, u in zip(alphas, units, strict=True):
        dot = torch.clamp(torch.dot(flat, u.flatten()), -1.0, 1.0)
        theta = torch.arccos(dot)
        if theta.item() < tol:
            continue
        step += alpha * (theta / torch.sin(theta)) * (u - dot * mean)
    return step


def karcher_mean(units: Sequence[torch.Tensor], alphas: Sequence[float], max_iter: int,
                 tol: float) -> torch.Tensor:
    """The weighted Karcher mean of unit vectors (``alphas`` sum to one).

    Fixed-point iteration from the normalised Euclidean mean. Scalars stay 0-d tensors
    and every step keeps the compute dtype, op for op as mergekit 0.1.5, whose bytes a
    recipe written for it expects."""
    import torch

    mean = torch.zeros_like(units[0])
    for alpha, u in zip(alphas, units, strict=True):
        mean += alpha * u
    norm = _norm(mean)
    # Directions that cancel have no Euclidean mean to start from; start at the first.
    mean = units[0].clone() if norm.item() < tol else (mean / norm).to(mean.dtype)
    for _ in range(max_iter):
        step = _tangent(mean, units, alphas, tol)
        size = _norm(step)
        if size.item() < tol:
            break
        # The exponential map: walk the geodesic from mean along step.
        mean = (torch.cos(size) * mean + torch.sin(size) * (step / size)).to(mean.dtype)
        norm = _norm(mean)
        if norm.item() > tol:
            mean = (mean / norm).to(mean.dtype)
    return mean


class Karcher(TensorMethod):
    name = "karcher"
    paper = ("Karcher 1977, Riemannian center of mass and mollifier smoothing "
             "(Comm. Pure Appl. Math. 30(5)); for model merging see arXiv:2603.04972")
    params = KarcherParams
    # Equal weights, as in mergekit (which takes no per-model parameters either).
    model_params = NoParams
    needs_base = False
    min_models = 1

    def merge(self, call: TensorCall) -> torch.Tensor:
        """``(mean of ‖x_i‖) · KarcherMean(x_i / ‖x_i‖)`` over the models and the base."""
        import torch

        # The base last, where mergekit adds it to the models it does not list.
        xs = [*call.models, *([call.base] if call.base is not None else [])]
        if len(xs) == 1:
            return xs[0]
        tol = call.params.tol
        norms = [_norm(x) for x in xs]
        alpha = 1.0 / len(xs)
        valid = [i for i, n in enumerate(norms) if n.item() > tol]
        if not valid:
            return torch.zeros_like(xs[0])
        units = [(xs[i] / norms[i]).to(xs[i].dtype) for i in valid]
        # Equal weights over the inputs with a direction, normalised as a float sum (for
        # ten inputs that is not exactly 1, and mergekit's weights carry the difference).
        total = sum([alpha] * len(valid))
        mean = karcher_mean(units, [alpha / total] * len(valid), call.params.max_iter, tol)
        # Every input's norm counts, a zero one too, each with weight 1/n.
        scale = sum((alpha * n for n in norms), torch.zeros((), dtype=norms[0].dtype))
        return scale * mean
