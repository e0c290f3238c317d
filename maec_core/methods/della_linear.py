"""DELLA's MagPrune task vectors added linearly (Deep et al. 2024, arXiv:2406.11617).

Pruning, rescaling, seeding and the band check as in :mod:`maec_core.methods.della`;
parameter names and defaults follow mergekit 0.1.5 (``normalize`` off, ``rescale`` on).
"""

from __future__ import annotations

from typing import ClassVar

from maec_core.methods.della import Della, DellaParams


class DellaLinearParams(DellaParams):
    normalize: bool = False


class DellaLinear(Della):
    """``θ0 + λ Σ w_i MagPrune(τ_i)`` (divided by ``Σ w_i`` with normalize)."""

    name = "della_linear"
    paper = ("Deep et al. 2024, DELLA-Merging (arXiv:2406.11617), task vectors added "
             "linearly")
    params = DellaLinearParams
    elect: ClassVar[bool] = False
