"""Every merge method registered both here and in mergekit 0.1.5 accepts the parameters
mergekit accepts (global and per model), with the same defaults.

Read from mergekit's own registry (each method's ``spec.parameters``), so a parameter
added there shows up here as a failure.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

registry = pytest.importorskip("mergekit.merge_methods.registry")
from mergekit.merge_methods.base import ParameterScope  # noqa: E402

from maec_core.methods import all_methods  # noqa: E402
from maec_core.parsing import parse_recipe  # noqa: E402

# Parameters accepted here that mergekit does not know, and why.
EXTRA_HERE: dict[str, set[str]] = {
    # The drop masks come from a generator seeded per tensor (mergekit draws from
    # torch's global generator), so a recipe names its seed.
    "dare_ties": {"random_seed"},
    "dare_linear": {"random_seed"},
    "della": {"random_seed"},
    "della_linear": {"random_seed"},
    # The norm below which slerp falls back to linear interpolation (fixed in mergekit).
    "slerp": {"eps"},
}
# Required in mergekit, given a default here: every recipe mergekit runs means the same
# here; a recipe that leaves them out runs here instead of failing.
DEFAULTED_HERE: dict[str, Any] = {"weight": 1.0, "t": 0.5}


def mergekit_methods() -> dict[str, Any]:
    return {m.spec.name: m.spec for m in registry.registered_methods()}


def shared_names() -> list[str]:
    ours = {m.name for m in all_methods()}
    return sorted(ours & set(mergekit_methods()))


def accepted(model: type[BaseModel]) -> dict[str, Any]:
    """Accepted key -> default (PydanticUndefined when required)."""
    return {(f.alias or name): f.default for name, f in model.model_fields.items()}


def test_the_registries_share_the_mergekit_methods() -> None:
    # Every mergekit method but the RAM pair is here.
    assert set(mergekit_methods()) - set(shared_names()) <= {"ram", "ramplus_tl"}
    assert len(shared_names()) >= 18


@pytest.mark.parametrize("name", shared_names())
def test_accepted_parameters_match_mergekit(name: str) -> None:
    method = next(m for m in all_methods() if m.name == name)
    spec = mergekit_methods()[name]
    theirs_global = {p.name: p for p in spec.parameters if p.scope == ParameterScope.SHARED}
    theirs_model = {p.name: p for p in spec.parameters if p.scope != ParameterScope.SHARED}
    ours_global, ours_model = accepted(method.params), accepted(method.model_params)

    assert set(ours_global) - EXTRA_HERE.get(name, set()) == set(theirs_global)
    assert set(ours_model) == set(theirs_model)
    for ours, theirs in ((ours_global, theirs_global), (ours_model, theirs_model)):
        for key, p in theirs.items():
            if p.required:
                assert ours[key] in (PydanticUndefined, DEFAULTED_HERE.get(key)), key
            else:
                assert ours[key] == p.default, key


def test_task_arithmetic_accepts_density_and_ignores_it() -> None:
    def recipe(density: object) -> dict[str, object]:
        return {"merge_method": "task_arithmetic", "base_model": "b",
                "models": [{"model": "a", "parameters": {"weight": 0.5,
                                                          "density": density}}]}

    from tests.core.test_methods import call

    parse_recipe(recipe(0.3))
    parse_recipe(recipe([0.1, 0.9]))
    base, a = [1.0, 2.0, 3.0], [[2.0, 0.0, 5.0]]
    assert call("task_arithmetic", base, a, [{"weight": 0.5, "density": 0.2}]).tolist() == \
        call("task_arithmetic", base, a, [{"weight": 0.5}]).tolist()
