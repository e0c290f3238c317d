"""Tensor implementations of the merge methods, looked up by name."""

from __future__ import annotations

from collections.abc import Callable

from maec_core.errors import RecipeError
from maec_core.methods.base import MergeFn

_IMPLS: dict[str, MergeFn] = {}


def register(name: str) -> Callable[[MergeFn], MergeFn]:
    def deco(fn: MergeFn) -> MergeFn:
        _IMPLS[name] = fn
        return fn

    return deco


def get_impl(name: str) -> MergeFn:
    # Importing the modules registers their functions.
    from maec_core.methods import basic, dare, layer_swap, slerp, ties  # noqa: F401

    try:
        return _IMPLS[name]
    except KeyError:
        raise RecipeError(f"merge_method '{name}' has no tensor implementation") from None
