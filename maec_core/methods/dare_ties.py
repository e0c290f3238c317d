"""DARE task vectors combined with TIES sign election (Yu et al. 2024, arXiv:2311.03099).

Drop, rescale and seeding as in :mod:`maec_core.methods.dare_linear`.
"""

from __future__ import annotations

from typing import ClassVar

from maec_core.methods.dare_linear import DareLinear


class DareTies(DareLinear):
    """DARE task vectors combined with TIES sign election and disjoint mean."""

    name = "dare_ties"
    paper = ("Yu et al. 2024, Language models are Super Mario (arXiv:2311.03099) "
             "with TIES sign election")
    elect: ClassVar[bool] = True
