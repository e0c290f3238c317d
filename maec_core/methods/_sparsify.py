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


def trim_magnitude_(delta: torch.Tensor, density: float) -> torch.Tensor:
    """Zero all but the ``density`` fraction of entries largest in magnitude, in place.

    At least one entry survives in a non-empty tensor. Entries tied with the k-th largest
    magnitude all survive: a threshold (not an index set) makes the result independent of
    sort stability and of the device, at the cost of keeping a few extra entries when
    low-precision inputs produce exact ties.
    """
    n = delta.numel()
    if density >= 1.0 or n == 0:
        return delta
    k = max(1, int(density * n))
    mags = delta.abs().reshape(-1)
    # The k-th largest is the (n - k + 1)-th smallest.
    threshold = _kth_smallest(mags, n - k + 1)
    return delta.masked_fill_((mags < threshold).reshape(delta.shape), 0.0)


def trim_outliers_(delta: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    """Model Breadcrumbs' mask, in place: drop the ``gamma`` fraction largest in
    magnitude and then the smallest, so that a ``density`` fraction survives.

    Counts as in mergekit 0.1.5: ``int(density·n)`` survive (none when that is 0) and
    ``int(gamma·n)`` outliers go, fewer when both together exceed n. Like
    :func:`trim_magnitude_`, magnitude thresholds decide: entries tied with a
    threshold survive with it.
    """
    n = delta.numel()
    if density >= 1.0 or n == 0:
        return delta
    keep = int(density * n)
    if keep == 0:
        return delta.zero_()
    n_top = int(gamma * n)
    n_bottom = max(0, n - keep - n_top)
    mags = delta.abs().reshape(-1)
    # Survivors are the (n_bottom + 1)-th to the (n_bottom + keep)-th smallest.
    low = _kth_smallest(mags, n_bottom + 1)
    high = _kth_smallest(mags, n_bottom + keep)
    drop = (mags < low) | (mags > high)
    return delta.masked_fill_(drop.reshape(delta.shape), 0.0)


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


def magprune_(
    delta: torch.Tensor, density: float, epsilon: float, gen: torch.Generator, *,
    rescale: bool,
) -> torch.Tensor:
    """DELLA's MagPrune, in place: keep each entry with a probability that rises
    linearly with its magnitude rank, from ``density − epsilon`` (smallest) to
    ``density + epsilon`` (largest).

    Ranks run along dimension 1 (a tensor of fewer dimensions is one row), as in
    mergekit 0.1.5; a row of one entry, which has no rank spread, keeps it with
    probability ``density``. Magnitude ties are ranked in index order (a stable sort),
    so the mask depends only on the values and the generator. With ``rescale`` the
    survivors are scaled back to the delta's L1 norm before pruning (mergekit's rescale
    for this family). The uniform draws come from ``gen`` on the CPU, so CUDA and CPU
    merges of one recipe agree.
    """
    import torch

    if density >= 1.0 or delta.numel() == 0:
        return delta
    rows = delta.unsqueeze(0) if delta.dim() < 2 else delta
    n = rows.shape[1]
    order = rows.abs().argsort(dim=1, stable=True)
    # Invert the permutation with one scatter instead of a second sort.
    positions = torch.arange(n, device=delta.device).view(1, n, *([1] * (rows.dim() - 2)))
    ranks = torch.empty_like(order).scatter_(1, order, positions.expand_as(order))
    del order
    spread = ranks.to(delta.dtype).div_(n - 1) if n > 1 else torch.full_like(rows, 0.5)
    probs = spread.mul_(2 * epsilon).add_(density - epsilon).reshape(delta.shape)
    before = delta.abs().sum() if rescale else None
    draws = torch.rand(delta.shape, generator=gen, dtype=torch.float32)
    delta.mul_(draws.to(delta.device) < probs)
    if before is not None:
        rescale_l1_(delta, before)
    return delta
