"""Tensor implementations of the merge methods, looked up by name."""

from __future__ import annotations

from collections.abc import Callable

from maec_core.errors import RecipeError
from maec_core.methods.base import MergeFn

_IMPLS: dict[str, MergeFn] = {}
_ELEMENTWISE: set[str] = set()


def register(name: str, *, elementwise: bool = False) -> Callable[[MergeFn], MergeFn]:
    """Register ``fn`` as method ``name``.

    ``elementwise``: each output entry depends only on the same entry of the inputs (and
    on the tensor's name), so the engine may call ``fn`` on flat slices of a tensor.
    """

    def deco(fn: MergeFn) -> MergeFn:
        _IMPLS[name] = fn
        if elementwise:
            _ELEMENTWISE.add(name)
        return fn

    return deco


def _load() -> None:
    # Importing the modules registers their functions.
    from maec_core.methods import basic, dare, layer_swap, slerp, ties  # noqa: F401


def is_elementwise(name: str) -> bool:
    _load()
    return name in _ELEMENTWISE


def get_impl(name: str) -> MergeFn:
    _load()
    try:
        return _IMPLS[name]
    except KeyError:
        raise RecipeError(f"merge_method '{name}' has no tensor implementation") from None
