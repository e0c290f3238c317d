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

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import Field

from maec_core.methods.base import NoParams, Params, TensorCall, TensorMethod
from maec_core.methods.slerp import dot64

if TYPE_CHECKING:
    import torch


class KarcherParams(Params):
    max_iter: int = Field(10, ge=0)
    # Norms, angles and steps below this count as zero.
    tol: float = Field(1e-5, ge=0.0)


def _norm(x: torch.Tensor) -> float:
    flat = x.reshape(-1)
    return math.sqrt(dot64(flat, flat))


def _tangent(mean: torch.Tensor, units: Sequence[torch.Tensor], alphas: Sequence[float],
             tol: float) -> torch.Tensor:
    """``Σ α_i log_m(u_i)``: the weighted mean of the directions' log maps at ``mean``."""
    import torch

    step = torch.zeros_like(mean)
    flat = mean.reshape(-1)
    for alpha, u in zip(alphas, units, strict=True):
        dot = max(-1.0, min(1.0, dot64(flat, u.reshape(-1))))
        theta = math.acos(dot)
        if theta < tol:
            continue
        c = alpha * theta / math.sin(theta)
        step.add_(u, alpha=c).add_(mean, alpha=-c * dot)
    return step


def karcher_mean(units: Sequence[torch.Tensor], alphas: Sequence[float], max_iter: int,
                 tol: float) -> torch.Tensor:
    """The weighted Karcher mean of unit vectors (``alphas`` sum to one)."""
    import torch

    mean = torch.zeros_like(units[0])
    for alpha, u in zip(alphas, units, strict=True):
        mean.add_(u, alpha=alpha)
    norm = _norm(mean)
    # Directions that cancel have no Euclidean mean to start from; start at the first.
    mean = units[0].clone() if norm < tol else mean.div_(norm)
    for _ in range(max_iter):
        step = _tangent(mean, units, alphas, tol)
        size = _norm(step)
        if size < tol:
            break
        # The exponential map: walk the geodesic from mean along step.
        mean = mean.mul_(math.cos(size)).add_(step, alpha=math.sin(size) / size)
        norm = _norm(mean)
        if norm > tol:
            mean.div_(norm)
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
        units = [x.div_(n) for x, n in zip(xs, norms, strict=True) if n > tol]
        if not units:
            return torch.zeros_like(xs[0])
        alphas = [1.0 / len(units)] * len(units)
        mean = karcher_mean(units, alphas, call.params.max_iter, tol)
        return mean.mul_(sum(norms) / len(xs))
