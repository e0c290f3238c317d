"""Finding the merge methods: every module of this package, no hand-kept list.

A method registers itself when its class is defined (``MergeMethod.__init_subclass__``);
this module imports each module of the package once, on the first lookup, so a new
method is found as soon as its file exists. A method with a pipeline of its own (which
runs the engine, so sits above it) keeps its whole unit in its own package of
``maec_core`` and registers from that package's ``method`` module, found the same way.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from pathlib import Path
from typing import TypeVar, overload

from maec_core.errors import RecipeError
from maec_core.methods.base import _REGISTRY, MergeMethod
from maec_core.recipe.inputs import use_discovery

M = TypeVar("M", bound=MergeMethod)

_lock = threading.Lock()
_loaded = False


def _discover() -> None:
    global _loaded
    if _loaded:
        return
    # Locked: two threads resolving a first recipe at once must not see a half-filled
    # registry (the API validates in worker threads).
    with _lock:
        if _loaded:
            return
        for module in _method_modules():
            importlib.import_module(module)
        _loaded = True


# A recipe finds its method's inputs model (registered when the method is defined)
# only once every method is: the recipe model asks this registry first.
use_discovery(_discover)


def _method_modules() -> list[str]:
    """Every module of this package, then ``maec_core.<unit>.method`` for each package of
    the core that has one. Looked up on disk, not imported: importing every package of the
    core would pull torch into processes (the API) that must not load it."""
    package = importlib.import_module("maec_core.methods")
    modules = [f"{package.__name__}.{info.name}" for info in pkgutil.iter_modules(package.__path__)]
    core = importlib.import_module("maec_core")
    for root in core.__path__:
        for info in pkgutil.iter_modules([root]):
            if info.ispkg and (Path(root) / info.name / "method.py").is_file():
                modules.append(f"maec_core.{info.name}.method")
    return modules


def all_methods() -> list[MergeMethod]:
    """Every registered method, by name."""
    _discover()
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


@overload
def get_method(name: str) -> MergeMethod: ...
@overload
def get_method(name: str, kind: type[M]) -> M: ...


def get_method(name: str, kind: type[MergeMethod] = MergeMethod) -> MergeMethod:
    """The method called ``name``; RecipeError when unknown or not a ``kind``.

    ``kind=TensorMethod`` asks for a method the engine runs tensor by tensor.
    """
    _discover()
    method = _REGISTRY.get(name)
    if method is None:
        known = sorted(_REGISTRY)
        raise RecipeError(f"unknown merge_method '{name}'; known: {', '.join(known)}",
                          merge_method=name, known=known)
    if not isinstance(method, kind):
        raise RecipeError(f"merge_method '{name}' has no tensor implementation",
                          merge_method=name)
    return method

