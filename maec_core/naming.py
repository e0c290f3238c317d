"""Naming inputs by their references in what a run records (torch-free, a leaf).

A job's worker fetches every input to a local copy and merges those; what it publishes
(the manifest, recipe.yaml, the model card, reports) must name the recipe's own
references, never where the worker put the files.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def renamed(doc: Any, names: Mapping[str, str]) -> Any:
    """``doc`` (JSON) with every string that ``names`` holds replaced by its value."""
    if not names:
        return doc
    if isinstance(doc, str):
        return names.get(doc, doc)
    if isinstance(doc, list):
        return [renamed(v, names) for v in doc]
    if isinstance(doc, dict):
        return {k: renamed(v, names) for k, v in doc.items()}
    return doc
