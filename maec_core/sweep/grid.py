"""A sweep's candidates: one concrete recipe per point of the grid (torch-free).

Every candidate is validated by its method exactly as a recipe would be, so a value out
of a parameter's range is refused at submission, naming the candidate. For MAEC the
candidates are grouped by their extraction parameters: candidates of one group share
their ability vectors and differ only at combination time (``mu``, ``selection_ratio``).
"""

from __future__ import annotations

import itertools
import re
import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from maec_core.errors import RecipeError, SweepError
from maec_core.methods import all_methods, get_method
from maec_core.methods.base import MergeMethod, ReuseKey
from maec_core.recipe import Recipe
from maec_core.sweep.inputs import language_base

Number = int | float
# ``models[i].key``, or ``<entries>[i].key`` for a method's own list of entries.
_TARGETED = re.compile(r"^([a-z_]+)\[(\d+)\]\.(.+)$")


@dataclass(frozen=True)
class Candidate:
    """One point of the grid: its id (``c00``...), knob values and concrete recipe."""

    id: str
    index: int
    values: dict[str, Number]
    recipe: Recipe
    # Candidates with equal groups share the work their method says they can (MAEC: the
    # ability vectors); None: the method shares nothing.
    group: ReuseKey | None = None


@dataclass(frozen=True)
class _Knob:
    name: str
    scope: str  # "global", "models", "entries" (the method's own, e.g. MAEC's abilities)
    key: str
    index: int | None  # one entry's only, or every entry


def _numeric(annotation: Any) -> bool:
    if annotation in (int, float):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return bool(args) and all(a in (int, float) for a in args)
    return False


def _field(model: type[BaseModel], key: str) -> tuple[str, bool] | None:
    """(the field's name, whether it is numeric) for ``key`` (a name or an alias)."""
    for name, info in model.model_fields.items():
        if key in (name, info.alias):
            return name, _numeric(info.annotation)
    return None


def _knob(name: str, method: MergeMethod, recipe: Recipe) -> _Knob:
    m = _TARGETED.match(name)
    scope, index, key = (m.group(1), int(m.group(2)), m.group(3)) if m else ("", None, name)
    owner = _entries_owner(scope) if scope and scope != "models" else None
    if scope and scope != "models" and owner is None:
        scope, index, key = "", None, name  # no list of that name: a plain (unknown) key
    per_entry = key in method.entry_knobs
    if owner is None and not scope and per_entry:
        owner = method  # a key of every entry: ``mu`` for all of MAEC's abilities
    if owner is not None:
        if owner is not method or not per_entry:
            raise SweepError(f"sweep knob {name!r}: only {owner.name.upper()} "
                             f"{owner.entries} have a swept value, "
                             f"{', '.join(sorted(owner.entry_knobs))}", knob=name)
        _check_index(name, index, method.entry_count(recipe))
        return _Knob(name, "entries", key, index)
    found = None if scope else _field(method.params, key)
    where = "global"
    if found is None:
        found, where = _field(method.model_params, key), "models"
        if scope == "models":
            _check_index(name, index, len(recipe.models))
    if found is None:
        raise SweepError(f"sweep knob {name!r} is not a parameter of merge_method "
                         f"'{method.name}'", knob=name, merge_method=method.name)
    if not found[1]:
        raise SweepError(f"sweep knob {name!r} is not a numeric parameter", knob=name)
    return _Knob(name, where, key, index)


def _entries_owner(scope: str) -> MergeMethod | None:
    """The method whose own list of entries is called ``scope`` (None: none)."""
    return next((m for m in all_methods() if m.entries == scope), None)


def _check_index(name: str, index: int | None, n: int) -> None:
    if index is not None and index >= n:
        raise SweepError(f"sweep knob {name!r}: the recipe has {n} entries there", knob=name)


def _apply(recipe: Recipe, method: MergeMethod, knob: _Knob, value: Number) -> Recipe:
    if knob.scope == "global":
        return recipe.model_copy(update={"parameters": {**recipe.parameters, knob.key: value}})
    if knob.scope == "entries":
        return method.with_entry_value(recipe, knob.key, knob.index, value)
    models = [m.model_copy(update={"parameters": {**m.parameters, knob.key: value}})
              if knob.index in (None, i) else m
              for i, m in enumerate(recipe.models)]
    return recipe.model_copy(update={"models": models})


def candidates(recipe: Recipe) -> list[Candidate]:
    """Every candidate of ``recipe.sweep`` in grid order (SweepError naming the first
    knob or candidate that cannot run)."""
    sweep = recipe.sweep
    if sweep is None:
        raise SweepError("the recipe has no sweep block")
    if not recipe.evaluate:
        raise SweepError("a sweep needs evaluate (its candidates are compared on them)")
    method = get_method(recipe.merge_method)
    c = sweep.constraint
    if c is not None and c.reference is not None and language_base(recipe) is None:
        raise SweepError(f"the constraint compares against {c.reference}, which this "
                         "recipe does not have", constraint=c.reference)
    knobs = [_knob(name, method, recipe) for name in sweep.grid]
    plain = recipe.merge_only()
    out: list[Candidate] = []
    width = max(2, len(str(sweep.size - 1)))
    for i, combo in enumerate(itertools.product(*sweep.grid.values())):
        cid = f"c{i:0{width}d}"
        values = dict(zip(sweep.grid, combo, strict=True))
        concrete = plain
        for knob, value in zip(knobs, combo, strict=True):
            concrete = _apply(concrete, method, knob, value)
        concrete = concrete.model_copy(update={"name": _name(recipe, cid)})
        try:
            method.validate(concrete)
        except RecipeError as exc:
            shown = ", ".join(f"{k}={v}" for k, v in values.items())
            raise SweepError(f"sweep candidate {cid} ({shown}): {exc.message}",
                             candidate=cid, values=values) from None
        out.append(Candidate(cid, i, values, concrete, method.reuse_key(concrete)))
    return out


def _name(recipe: Recipe, cid: str) -> str:
    return f"{recipe.name} ({cid})" if recipe.name else cid


def extraction_groups(cands: list[Candidate]) -> int:
    """How many distinct runs of shared work (MAEC: extractions per donor) the
    candidates need."""
    return len({c.group for c in cands if c.group is not None})
