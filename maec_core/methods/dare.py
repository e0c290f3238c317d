"""DARE: drop and rescale task vectors, then add them linearly or TIES-style.

Yu et al. 2024, "Language Models are Super Mario" (arXiv:2311.03099). Each entry of each
task vector survives with probability ``density`` (= 1 − p) and survivors are scaled by
1/density, which keeps the expected task vector unchanged.

Reproducibility: one CPU ``torch.Generator`` per tensor, seeded with the crc32 of
``random_seed`` and the tensor name, draws the masks of the models in recipe order. The masks
thus depend only on the recipe and the tensor's name, not on the device, on the order in
which tensors are processed or on which other tensors exist.
"""

from __future__ import annotations

import zlib

import torch

from maec_core.methods.base import TensorCall
from maec_core.methods.registry import register
from maec_core.methods.ties import elect_and_merge


def tensor_generator(random_seed: int, name: str) -> torch.Generator:
    """A CPU generator whose stream depends only on ``random_seed`` and ``name``."""
    # The CPU generator (mt19937) keeps only 32 bits of its seed, so seed and name are
    # mixed into one crc32 rather than packed side by side into 64 bits.
    seed = zlib.crc32(f"{random_seed}:{name}".encode())
    return torch.Generator(device="cpu").manual_seed(seed)


def drop_and_rescale_(
    delta: torch.Tensor, density: float, gen: torch.Generator, *, rescale: bool
) -> torch.Tensor:
    """Keep each entry with probability ``density`` (in place); scale survivors by 1/density."""
    if density >= 1.0:
        return delta
    # Drawn on the CPU so CUDA and CPU merges of one recipe agree bit for bit.
    keep = torch.rand(delta.shape, generator=gen, dtype=torch.float32) < density
    delta.mul_(keep.to(delta.device))
    if rescale:
        delta.div_(density)
    return delta


def _dropped_deltas(call: TensorCall) -> tuple[list[torch.Tensor], list[float]]:
    assert call.base is not None
    gen = tensor_generator(call.params.random_seed, call.name)
    deltas, weights = [], []
    for t, p in zip(call.models, call.model_params, strict=True):
        d = drop_and_rescale_(t - call.base, p.density, gen, rescale=call.params.rescale)
        deltas.append(d.mul_(p.weight))
        weights.append(p.weight)
    return deltas, weights


@register("dare_linear")
def dare_linear(call: TensorCall) -> torch.Tensor:
    """``θ0 + λ Σ w_i DARE(τ_i)`` (divided by ``Σ w_i`` with normalize)."""
    assert call.base is not None
    deltas, weights = _dropped_deltas(call)
    mixed = deltas[0]
    for d in deltas[1:]:
        mixed.add_(d)
    total = sum(weights)
    if call.params.normalize and abs(total) > 1e-8:
        mixed.div_(total)
    if call.params.lambda_ != 1.0:
        mixed.mul_(call.params.lambda_)
    return mixed.add_(call.base)


@register("dare_ties")
def dare_ties(call: TensorCall) -> torch.Tensor:
    """DARE task vectors combined with TIES sign election and disjoint mean."""
    assert call.base is not None
    deltas, weights = _dropped_deltas(call)
    return elect_and_merge(
        call.base, deltas, weights, normalize=call.params.normalize,
        lambda_=call.params.lambda_,
    )
