"""The exact selection rules of the method document, in torch.

Key neurons: keep ``k = max(1, ceil(key_ratio * n))`` by descending float32 score, ties
to the lower index (then the tensor name, for ``rank_scope: global``). ``torch.topk``
does not define the order of ties, so we find the k-th largest value with ``kthvalue``
(values are exact whatever the tie order), keep everything strictly above it, and take
the remaining places from the tied entries in ascending index order. That is O(n) and
deterministic on every device.

Ability-tensor selection: ``|c_t| <= threshold``, or the ``ceil(ratio * T)`` lowest
``|c_t|``, ties by tensor name.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from maec_core.errors import CheckpointError
from maec_core.maec.params import ceil_count


def check_scores(name: str, scores: torch.Tensor) -> None:
    if not bool(torch.isfinite(scores).all()):
        raise CheckpointError(
            f"importance scores of tensor {name!r} are not finite (NaN or inf weights in "
            "the inputs)",
            tensor=name,
        )


def top_k_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 indices of the ``k`` largest entries of 1-D ``scores``.

    Ties at the cut go to the lower index.
    """
    n = scores.numel()
    if k >= n:
        return torch.arange(n, device=scores.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=scores.device)
    # The k-th largest is the (n - k + 1)-th smallest.
    cut = torch.kthvalue(scores, n - k + 1).values
    above = scores > cut
    need = k - int(above.sum())
    tied = torch.nonzero(scores == cut).flatten()[:need]
    above[tied] = True
    return torch.nonzero(above).flatten()


def global_top_k(
    scores: Sequence[torch.Tensor], names: Sequence[str], k: int
) -> list[torch.Tensor]:
    """Top ``k`` across several tensors' 1-D scores; per tensor, ascending indices.

    Ties at the cut go to the lower index, then to the tensor name in sorted order.
    """
    order = sorted(range(len(names)), key=lambda i: names[i])
    flat = torch.cat([scores[i].float().flatten() for i in order])
    n = flat.numel()
    sizes = [scores[i].numel() for i in order]
    keep = torch.zeros(n, dtype=torch.bool, device=flat.device)
    if k >= n:
        keep[:] = True
    elif k > 0:
        cut = torch.kthvalue(flat, n - k + 1).values
        keep = flat > cut
        need = k - int(keep.sum())
        tied = torch.nonzero(flat == cut).flatten()
        if need > 0:
            # Position p in ``flat`` is (tensor rank r, local index j); ties order by
            # (j, r): sort the tied entries by that composite key and take the first.
            offsets = torch.tensor([0, *sizes[:-1]], device=flat.device).cumsum(0)
            rank = torch.bucketize(tied, offsets, right=True) - 1
            local = tied - offsets[rank]
            composite = local * len(order) + rank
            chosen = tied[torch.argsort(composite, stable=True)[:need]]
            keep[chosen] = True
    out: list[torch.Tensor] = [torch.empty(0)] * len(names)
    for i, part in zip(order, torch.split(keep, sizes), strict=True):
        out[i] = torch.nonzero(part).flatten()
    return out


def select_tensors(
    cosines: dict[str, float], *, mode: str, ratio: float, threshold: float | None
) -> set[str]:
    """Names of the tensors whose ability weights are added (the low-|c_t| ones)."""
    if mode == "threshold":
        assert threshold is not None
        return {name for name, c in cosines.items() if abs(c) <= threshold}
    keep = ceil_count(ratio, len(cosines))
    ranked = sorted(cosines, key=lambda name: (abs(cosines[name]), name))
    return set(ranked[:keep])
