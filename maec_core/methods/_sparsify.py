"""Ways to sparsify a task vector before it is combined (TIES, DARE, Model Breadcrumbs).

Every function works in place on a delta that belongs to the call. torch is imported
inside the functions: the API imports every module of the package without torch.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _kth_smallest(mags: torch.Tensor, k: int) -> torch.Tensor:
    import torch

    return torch.kthvalue(mags, k).values


def mergekit_order(mags: torch.Tensor, *, descending: bool, dim: int = -1) -> torch.Tensor:
    """Indices that sort ``mags`` along ``dim`` the way mergekit 0.1.5 does on the CPU.

    mergekit ranks with torch's default sort, which is not stable: the order it gives
    tied values depends on the whole row, not on their positions alone, so no stable
    sort reproduces it. The same call on the float32 values on the CPU does, and is a
    function of the values only, so CUDA and CPU merges agree. Callers take this path
    only when ties straddle a cut (rare in real weights): it costs a full sort and a
    copy to the CPU.
    """
    import torch

    key = mags.detach().to(device="cpu", dtype=torch.float32)
    return torch.argsort(key, dim=dim, descending=descending).to(mags.device)


def _keep_indices(n: int, indices: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    import torch

    keep = torch.zeros(n, dtype=torch.bool, device=like.device)
    keep[indices] = True
    return keep


def trim_magnitude_(delta: torch.Tensor, density: float) -> torch.Tensor:
    """Zero all but the ``density`` fraction of entries largest in magnitude, in place.

    Exactly ``max(1, int(density·n))`` entries survive in a non-empty tensor. A
    magnitude threshold decides when it selects exactly that many; when entries tied
    with the threshold make it select more, the survivors are the first in mergekit's
    descending order (:func:`mergekit_order`).
    """
    n = delta.numel()
    if density >= 1.0 or n == 0:
        return delta
    k = max(1, int(density * n))
    mags = delta.abs().reshape(-1)
    # The k-th largest is the (n - k + 1)-th smallest.
    threshold = _kth_smallest(mags, n - k + 1)
    keep = mags >= threshold
    if int(keep.sum()) != k:
        keep = _keep_indices(n, mergekit_order(mags, descending=True)[:k], mags)
    return delta.masked_fill_(~keep.reshape(delta.shape), 0.0)


def trim_outliers_(delta: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    """Model Breadcrumbs' mask, in place: drop the ``gamma`` fraction largest in
    magnitude and then the smallest, so that a ``density`` fraction survives.

    Counts as in mergekit 0.1.5: ``int(density·n)`` survive (none when that is 0) and
    ``int(gamma·n)`` outliers go, fewer when both together exceed n. As in
    :func:`trim_magnitude_`, two magnitude thresholds decide unless ties straddle one;
    then the survivors are positions ``n_bottom`` to ``n_bottom + keep`` of mergekit's
    ascending order.
    """
    n = delta.numel()
    if density >= 1.0 or n == 0:
        return delta
    keep_n = int(density * n)
    if keep_n == 0:
        return delta.zero_()
    n_top = int(gamma * n)
    n_bottom = max(0, n - keep_n - n_top)
    mags = delta.abs().reshape(-1)
    # Survivors are the (n_bottom + 1)-th to the (n_bottom + keep_n)-th smallest.
    low = _kth_smallest(mags, n_bottom + 1)
    high = _kth_smallest(mags, n_bottom + keep_n)
    keep = (mags >= low) & (mags <= high)
    if int((mags < low).sum()) != n_bottom or int(keep.sum()) != keep_n:
        order = mergekit_order(mags, descending=False)
        keep = _keep_indices(n, order[n_bottom:n_bottom + keep_n], mags)
    return delta.masked_fill_(~keep.reshape(delta.shape), 0.0)


def rescale_l1_(delta: torch.Tensor, before: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """Scale a sparsified ``delta`` back to the L1 norm ``before`` it had (in place).

    mergekit's ``rescale`` for magnitude-based sparsification; skipped when either norm
    is below ``eps`` (nothing meaningful to match).
    """
    after = delta.abs().sum()
    if float(before) < eps or float(after) < eps:
        return delta
    return delta.mul_(before / after)


def tensor_generator(random_seed: int, name: str) -> torch.Generator:
    """A CPU generator whose stream depends only on ``random_seed`` and ``name``."""
    import torch

    # The CPU generator (mt19937) keeps only 32 bits of its seed, so seed and name are
    # mixed into one crc32 rather than packed side by side into 64 bits.
    seed = zlib.crc32(f"{random_seed}:{name}".encode())
    return torch.Generator(device="cpu").manual_seed(seed)


def drop_and_rescale_(
    delta: torch.Tensor, density: float, gen: torch.Generator, *, rescale: bool
) -> torch.Tensor:
    """Keep each entry with probability ``density`` (in place); scale survivors by 1/density."""
    import torch

    if density >= 1.0:
        return delta
    # Drawn on the CPU so CUDA and CPU merges of one recipe agree bit for bit.
    keep = torch.rand(delta.shape, generator=gen, dtype=torch.float32) < density
    delta.mul_(keep.to(delta.device))
    if rescale:
        delta.div_(density)
    return delta


def magnitude_ranks(rows: torch.Tensor) -> torch.Tensor:
    """Each entry's 0-based rank by magnitude along dimension 1 (0: the smallest).

    Ties are ranked as mergekit 0.1.5 ranks them (:func:`mergekit_order`); a fast
    sort decides when a tensor has no tied magnitudes in any row.
    """
    import torch

    n = rows.shape[1]
    mags = rows.abs()
    values, order = mags.sort(dim=1, stable=True)
    if n > 1 and bool((values.narrow(1, 1, n - 1) == values.narrow(1, 0, n - 1)).any()):
        order = mergekit_order(mags, descending=False, dim=1)
    del values, mags
    # Invert the permutation with one scatter instead of a second sort.
    positions = torch.arange(n, device=rows.device).view(1, n, *([1] * (rows.dim() - 2)))
    return torch.empty_like(order).scatter_(1, order, positions.expand_as(order))


def magprune_(
    delta: torch.Tensor, density: float, epsilon: float, gen: torch.Generator, *,
    rescale: bool,
) -> torch.Tensor:
    """DELLA's MagPrune, in place: keep each entry with a probability that rises
    linearly with its magnitude rank, from ``density − epsilon`` (smallest) to
    ``density + epsilon`` (largest).

    Ranks run along dimension 1 (a tensor of fewer dimensions is one row), as in
    mergekit 0.1.5; a row of one entry, which has no rank spread, keeps it with
    probability ``density``. Magnitude ties are ranked as mergekit ranks them
    (:func:`magnitude_ranks`), so the mask depends only on the values and the
    generator. With ``rescale`` the survivors are scaled back to the delta's L1 norm
    before pruning (mergekit's rescale for this family). The uniform draws come from
    ``gen`` on the CPU, so CUDA and CPU merges of one recipe agree.
    """
    import torch

    if density >= 1.0 or delta.numel() == 0:
        return delta
    rows = delta.unsqueeze(0) if delta.dim() < 2 else delta
    n = rows.shape[1]
    ranks = magnitude_ranks(rows)
    spread = ranks.to(delta.dtype).div_(n - 1) if n > 1 else torch.full_like(rows, 0.5)
    probs = spread.mul_(2 * epsilon).add_(density - epsilon).reshape(delta.shape)
    before = delta.abs().sum() if rescale else None
    draws = torch.rand(delta.shape, generator=gen, dtype=torch.float32)
    delta.mul_(draws.to(delta.device) < probs)
    if before is not None:
        rescale_l1_(delta, before)
    return delta
