"""Model Breadcrumbs task vectors combined with TIES sign election and disjoint mean.

Trimming as in :mod:`maec_core.methods.breadcrumbs`; parameter names and defaults follow
mergekit 0.1.5 (normalize off).
"""

from __future__ import annotations

from typing import ClassVar

from maec_core.methods.breadcrumbs import Breadcrumbs


class BreadcrumbsTies(Breadcrumbs):
    """``θ0 + λ · disjoint_mean(sign-elected breadcrumbs(w_i τ_i))``."""

    name = "breadcrumbs_ties"
    paper = ("Davari and Belilovsky 2024, Model Breadcrumbs (arXiv:2312.06795) with "
             "TIES sign election")
    elect: ClassVar[bool] = True
