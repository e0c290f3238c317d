"""Ties in magnitude (or variance) at a sparsifying cut are broken as mergekit 0.1.5
breaks them: TIES' trim, Model Breadcrumbs' outlier trim, DELLA's ranks and SCE's
selection, each against mergekit's own function on tensors with planted ties."""

from __future__ import annotations

import pytest
import torch

sparsify = pytest.importorskip("mergekit.sparsify")
sce = pytest.importorskip("mergekit.merge_methods.sce")

from maec_core.methods._sparsify import (  # noqa: E402
    magnitude_ranks,
    trim_magnitude_,
    trim_outliers_,
)
from maec_core.methods.sce import select_mask  # noqa: E402

# Sizes on both sides of the point where torch's CPU sort stops being an insertion sort.
SIZES = [4, 17, 100, 1024, 5000]


def planted(n: int, seed: int, levels: int) -> torch.Tensor:
    """Non-zero entries drawn from ``levels`` magnitudes with random signs: many ties."""
    gen = torch.Generator().manual_seed(seed)
    mags = torch.randint(1, levels + 1, (n,), generator=gen).float()
    signs = torch.randint(0, 2, (n,), generator=gen).float().mul_(2).sub_(1)
    return mags * signs


def paired(n: int, seed: int) -> torch.Tensor:
    """Distinct random magnitudes except for a few planted equal pairs."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=gen)
    idx = torch.randperm(n, generator=gen)[: 2 * (min(n, 20) // 2)]
    t[idx[1::2]] = -t[idx[0::2]]
    return t


CASES = [(n, seed, kind) for n in SIZES for seed in range(3) for kind in ("levels", "pairs")]


def tensor(n: int, seed: int, kind: str) -> torch.Tensor:
    return planted(n, seed, levels=5) if kind == "levels" else paired(n, seed)


@pytest.mark.parametrize(("n", "seed", "kind"), CASES)
@pytest.mark.parametrize("density", [0.01, 0.25, 0.5, 0.9])
def test_trim_magnitude_matches_mergekit(n: int, seed: int, kind: str,
                                         density: float) -> None:
    t = tensor(n, seed, kind)
    want = sparsify.magnitude(t, density)
    got = trim_magnitude_(t.clone(), density)
    assert torch.equal(got, want)
    assert int((got != 0).sum()) == max(1, int(density * n))


def test_trim_magnitude_ties_on_a_matrix() -> None:
    t = planted(64 * 48, 7, levels=3).reshape(64, 48)
    assert torch.equal(trim_magnitude_(t.clone(), 0.3), sparsify.magnitude(t, 0.3))


@pytest.mark.parametrize(("n", "seed", "kind"), CASES)
@pytest.mark.parametrize(("density", "gamma"), [(0.3, 0.05), (0.5, 0.01), (0.9, 0.2),
                                                (0.01, 0.0)])
def test_trim_outliers_matches_mergekit(n: int, seed: int, kind: str, density: float,
                                        gamma: float) -> None:
    t = tensor(n, seed, kind)
    want = sparsify.magnitude_outliers(t, density, gamma=gamma)
    got = trim_outliers_(t.clone(), density, gamma)
    assert torch.equal(got, want)
    assert int((got != 0).sum()) == int(density * n)


@pytest.mark.parametrize(("rows", "cols", "seed"), [(1, 17, 0), (3, 100, 1), (8, 1024, 2),
                                                    (4, 33, 3)])
@pytest.mark.parametrize("kind", ["levels", "pairs"])
def test_della_ranks_match_mergekit(rows: int, cols: int, seed: int, kind: str) -> None:
    t = tensor(rows * cols, seed, kind).reshape(rows, cols)
    # mergekit's della_magprune: rank = position in the (default) ascending sort by |t|
    # along dimension 1.
    want = torch.argsort(t.abs(), dim=1).argsort(dim=1)
    assert torch.equal(magnitude_ranks(t), want)


def test_della_ranks_without_ties_are_the_sorted_positions() -> None:
    t = torch.tensor([[4.0, -1.0, 3.0, 2.0], [0.5, -0.25, 0.75, 1.0]])
    assert magnitude_ranks(t).tolist() == [[3, 0, 2, 1], [1, 0, 2, 3]]


@pytest.mark.parametrize(("n", "seed"), [(17, 0), (100, 1), (1024, 2), (5000, 3)])
@pytest.mark.parametrize("fraction", [0.1, 0.35, 0.8])
def test_sce_selection_matches_mergekit(n: int, seed: int, fraction: float) -> None:
    # Two task vectors of small integers: every variance ((a - b) / 2)² is exact in both
    # tools, and only a few distinct values occur, so the cut falls inside a tie.
    a, b = planted(n, seed, levels=3), planted(n, seed + 100, levels=3)
    want = sce.sce_mask(torch.stack([a, b]), fraction).bool()
    got = select_mask([a.clone(), b.clone()], fraction)
    assert torch.equal(got, want)
    nonzero = int(torch.count_nonzero(a != b))
    assert int(got.sum()) == int(nonzero * fraction)
