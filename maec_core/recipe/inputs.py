"""A method's own top-level recipe keys: its inputs model, found through the methods.

The shared recipe names no method's inputs (as mergekit's ``MergeConfiguration`` has no
method-specific field). A method that reads top-level keys of its own declares them as
a :class:`MethodInputs` model; defining the method registers that model here by the
method's name (the recipe model sits below the methods, so they register into it, never
the other way round), and the methods' registry installs how to find them all
(:func:`use_discovery`) before any recipe is checked.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict

# Where a reference sits: the recipe's own roles (``base``, ``model``, ``slice_source``,
# ``tokenizer``) and those a method's inputs give (MAEC's ``language_base``, ...).
SourceRole = str


@dataclass(frozen=True)
class SourceRef:
    """One reference to a checkpoint or corpus in a recipe, and the place it sits.

    ``index`` is the entry's position in ``models``, ``slices`` or a method's own list
    of entries (None for the top-level fields); ``slot`` is a slice source's position in
    its slice. ``kind``: a checkpoint to read, a corpus file (``corpus``: the method
    that gives it says so), or the tokenizer (one of the recipe's checkpoints, or a
    tokenizer donor: ``Recipe.tokenizer_donor``).
    """

    role: SourceRole
    ref: str
    index: int | None = None
    slot: int | None = None
    corpus: bool = False

    @property
    def kind(self) -> Literal["checkpoint", "corpus", "tokenizer"]:
        if self.corpus:
            return "corpus"
        return "tokenizer" if self.role == "tokenizer" else "checkpoint"


class MethodInputs(BaseModel):
    """Base of a method's inputs model: its own top-level keys (an unknown key inside
    them is an error naming it). Subclasses say where their references sit."""

    model_config = ConfigDict(extra="forbid")

    def sources(self) -> list[SourceRef]:
        """Every reference these inputs give: top-level ones (``index`` None) come
        right after the base, entries' after the recipe's models and slices."""
        return []

    def with_sources(self, mapping: Mapping[str, str]) -> Self:
        """A copy with every reference found in ``mapping`` replaced by its value."""
        return self

    def builds_on(self) -> str | None:
        """The checkpoint the merge builds on instead of ``base_model`` (what a LoRA
        export's adapter applies to); None: the base model."""
        return None


_INPUTS: dict[str, type[MethodInputs]] = {}
_discovery: list[Callable[[], None]] = []


def register_inputs(method: str, model: type[MethodInputs]) -> None:
    """Declare ``model`` as the top-level inputs of ``method`` (done when the method's
    class is defined)."""
    _INPUTS[method] = model


def use_discovery(discover: Callable[[], None]) -> None:
    """Have ``discover`` (the methods' registry: it defines every method, and so
    registers every inputs model) run before the inputs are looked up."""
    if discover not in _discovery:
        _discovery.append(discover)


def inputs_models() -> dict[str, type[MethodInputs]]:
    """Every method's inputs model, by method name (sorted)."""
    for discover in _discovery:
        discover()
    return {name: _INPUTS[name] for name in sorted(_INPUTS)}


def owned_keys(models: Mapping[str, type[MethodInputs]]) -> dict[str, str]:
    """Each top-level key some method owns, and that method."""
    return {key: method for method, model in models.items() for key in model.model_fields}
