"""Merge methods, one module each; look them up with :func:`get_method`.

A method module defines a :class:`MergeMethod` subclass (parameters, validation,
named-form mapping) and, for the engine, a tensor function (:class:`TensorMethod`).
Every module here is importable without torch.
"""

from maec_core.methods.base import MergeMethod, NamedForm, TensorCall, TensorMethod
from maec_core.methods.registry import all_methods, get_method

__all__ = [
    "MergeMethod",
    "NamedForm",
    "TensorCall",
    "TensorMethod",
    "all_methods",
    "get_method",
]
