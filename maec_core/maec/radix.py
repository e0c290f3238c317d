"""Global top-k over every weight of the model without holding the scores: radix select.

``granularity: element`` with ``rank_scope: global`` ranks billions of scores; holding
them (4 bytes each) would make memory grow with the model. Instead each candidate gets
a 96-bit key ordered exactly like the method's rule — float32 score bits (descending
score; non-negative floats order like their bit patterns), then the inverted composite
``index * T + tensor rank`` (ties to the lower index, then the tensor name) — and the
k-th largest key is found 16 bits at a time: one streaming pass per digit, each a
65536-bin histogram of the candidates that match the digits chosen so far. Passes stop
as soon as the bucket at the cut is taken whole, which for real-valued scores is after
the two score digits. Per-tensor histograms give each tensor's kept count (the artifact
header needs them before any value is written).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

BINS = 1 << 16
LEVELS = 6  # two digits of score bits, four of the inverted composite index
ScoreStream = Callable[[], Iterable[tuple[str, torch.Tensor]]]


def _digit(level: int, scores: torch.Tensor, rank: int, tensors: int, cmax: int
           ) -> torch.Tensor:
    if level < 2:
        bits = scores.reshape(-1).view(torch.int32).to(torch.int64)
        return bits >> 16 if level == 0 else bits & 0xFFFF
    idx = torch.arange(scores.numel(), dtype=torch.int64, device=scores.device)
    inv = cmax - (idx * tensors + rank)
    return (inv >> (16 * (5 - level))) & 0xFFFF


def _matches(scores: torch.Tensor, rank: int, tensors: int, cmax: int,
             prefix: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(key prefix > ``prefix``, key prefix == ``prefix``) per element, lexicographically."""
    n = scores.numel()
    gt = torch.zeros(n, dtype=torch.bool, device=scores.device)
    eq = torch.ones(n, dtype=torch.bool, device=scores.device)
    for level, d in enumerate(prefix):
        dig = _digit(level, scores, rank, tensors, cmax)
        gt |= eq & (dig > d)
        eq &= dig == d
    return gt, eq


class GlobalSelection:
    """The cut of a global top-k: keep an element iff its key prefix >= ``prefix``."""

    def __init__(self, ranks: dict[str, int], sizes: dict[str, int], k: int) -> None:
        self.ranks = ranks
        self.tensors = len(ranks)
        self.cmax = max(sizes.values(), default=1) * self.tensors
        self.total = sum(sizes.values())
        self.k = k
        self.prefix: list[int] = []
        self.counts: dict[str, int] = dict.fromkeys(sizes, 0)

    def keep(self, name: str, scores: torch.Tensor) -> torch.Tensor:
        """Ascending flat indices of the kept elements of tensor ``name``."""
        if self.k >= self.total:
            return torch.arange(scores.numel(), device=scores.device)
        gt, eq = _matches(scores, self.ranks[name], self.tensors, self.cmax, self.prefix)
        return torch.nonzero(gt | eq).flatten()


def select_global(stream: ScoreStream, sizes: dict[str, int], k: int) -> GlobalSelection:
    """Find the cut with one ``stream()`` pass per digit (usually two).

    ``stream()`` yields ``(tensor name, float32 non-negative scores)`` for every tensor,
    in any fixed order; ``sizes`` gives each tensor's number of candidates.
    """
    ranks = {name: i for i, name in enumerate(sorted(sizes))}
    sel = GlobalSelection(ranks, sizes, k)
    if k >= sel.total:
        sel.counts = dict(sizes)
        return sel
    need = k
    above = dict.fromkeys(sizes, 0)
    for level in range(LEVELS):
        hist = torch.zeros(BINS, dtype=torch.int64)
        local: dict[str, torch.Tensor] = {}
        for name, scores in stream():
            rank = ranks[name]
            _, eq = _matches(scores, rank, sel.tensors, sel.cmax, sel.prefix)
            dig = _digit(level, scores, rank, sel.tensors, sel.cmax)[eq]
            h = torch.bincount(dig, minlength=BINS).cpu()
            local[name] = h.to(torch.int32)  # 256 KB per tensor, one pass at a time
            hist += h
        from_top = hist.flip(0).cumsum(0)
        pos = int(torch.searchsorted(from_top, torch.tensor(need)))
        d = BINS - 1 - pos
        need -= int(from_top[pos]) - int(hist[d])
        sel.prefix.append(d)
        for name, h in local.items():
            above[name] += int(h[d + 1:].sum())
        if int(hist[d]) == need:
            # The whole bucket is taken: the cut is decided at this digit.
            for name, h in local.items():
                sel.counts[name] = above[name] + int(h[d])
            return sel
    raise AssertionError("keys are unique after all digits")  # pragma: no cover
