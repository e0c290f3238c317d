"""Methods as units: found without a list, torch-free to import, each owning its recipe
checks and named-form mapping; and the recipe's one walk over its sources."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import maec_core.methods as methods_pkg
from maec_core.errors import RecipeError
from maec_core.methods import (
    MergeMethod,
    NamedForm,
    TensorCall,
    TensorMethod,
    all_methods,
    get_method,
)
from maec_core.methods import base as base_mod
from maec_core.methods import registry as registry_mod
from maec_core.parsing import parse_recipe

ROOT = Path(__file__).resolve().parents[2]
BUILTIN = {"breadcrumbs", "breadcrumbs_ties", "dare_linear", "dare_ties", "layer_swap",
           "linear", "maec", "model_stock", "nearswap", "slerp", "task_arithmetic", "ties"}


def test_every_method_module_imports_without_torch() -> None:
    code = ("import json, sys; from maec_core.methods import all_methods; "
            "names = [m.name for m in all_methods()]; "
            "print(json.dumps([names, sorted(m for m in sys.modules "
            "if m.split('.')[0] == 'torch')]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    names, torch_modules = json.loads(out.stdout)
    assert set(names) >= BUILTIN
    assert torch_modules == []


def test_lookup() -> None:
    assert {m.name for m in all_methods()} >= BUILTIN
    assert [m.name for m in all_methods()] == sorted(m.name for m in all_methods())
    ties = get_method("ties", TensorMethod)
    assert ties.name == "ties" and not ties.elementwise
    assert get_method("linear", TensorMethod).elementwise
    assert isinstance(get_method("maec"), MergeMethod)
    with pytest.raises(RecipeError, match="no tensor implementation"):
        get_method("maec", TensorMethod)
    with pytest.raises(RecipeError, match=r"unknown merge_method 'tise'; known: .*ties"):
        get_method("tise")


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, MergeMethod]:
    """A copy of the registry that test-defined methods register into."""
    copy = dict(base_mod._REGISTRY)
    monkeypatch.setattr(base_mod, "_REGISTRY", copy)
    monkeypatch.setattr(registry_mod, "_REGISTRY", copy)
    return copy


def test_defining_a_class_registers_it(scratch_registry: dict[str, MergeMethod]) -> None:
    class Double(TensorMethod):
        name = "double_for_test"
        paper = "none"
        elementwise = True

        def merge(self, call: TensorCall) -> Any:
            return call.models[0] * 2

    assert isinstance(get_method("double_for_test", TensorMethod), Double)
    with pytest.raises(TypeError, match="defined twice"):
        type("Again", (TensorMethod,), {"name": "ties", "paper": "x",
                                        "merge": Double.merge})
    with pytest.raises(TypeError, match="does not define merge"):
        type("NoMerge", (TensorMethod,), {"name": "no_merge_for_test", "paper": "x"})
    with pytest.raises(TypeError, match="paper"):
        type("NoPaper", (MergeMethod,), {"name": "no_paper_for_test"})
    # A class without its own name is a base for others, not a method.
    type("Abstract", (TensorMethod,), {})
    assert "no_merge_for_test" not in scratch_registry


def test_a_new_module_is_found_without_editing_a_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    scratch_registry: dict[str, MergeMethod],
) -> None:
    (tmp_path / "zz_added_for_test.py").write_text(
        "from maec_core.methods.base import TensorMethod\n"
        "class Added(TensorMethod):\n"
        "    name = 'added_for_test'\n"
        "    paper = 'none'\n"
        "    def merge(self, call):\n"
        "        return call.models[0]\n"
    )
    monkeypatch.setattr(methods_pkg, "__path__", [*methods_pkg.__path__, str(tmp_path)])
    monkeypatch.setattr(registry_mod, "_loaded", False)
    monkeypatch.delitem(sys.modules, "maec_core.methods.zz_added_for_test", raising=False)
    try:
        recipe = parse_recipe({"merge_method": "added_for_test", "base_model": "b",
                               "models": [{"model": "a"}]})
        assert get_method(recipe.merge_method, TensorMethod).name == "added_for_test"
    finally:
        sys.modules.pop("maec_core.methods.zz_added_for_test", None)


def _named(method: str, **kw: Any) -> dict[str, Any]:
    form = NamedForm(base=kw.pop("base", "B"), ability_donor=kw.pop("donors", ["A"]),
                     language_base="L", **kw)
    return get_method(method).named_form(form)


def test_named_form_of_the_task_vector_methods() -> None:
    data = _named("ties", donors=["A1", "A2"],
                  parameters={"density": [0.2, 0.4, 0.6], "weight": 0.5, "lambda": 2})
    assert data == {
        "merge_method": "ties", "base_model": "B", "parameters": {"lambda": 2},
        "models": [{"model": "A1", "parameters": {"density": 0.2, "weight": 0.5}},
                   {"model": "A2", "parameters": {"density": 0.4, "weight": 0.5}},
                   {"model": "L", "parameters": {"density": 0.6, "weight": 0.5}}],
    }
    parse_recipe(data)
    crumbs = _named("breadcrumbs", parameters={"gamma": 0.02})
    assert [m["parameters"] for m in crumbs["models"]] == [{"gamma": 0.02}] * 2
    with pytest.raises(RecipeError, match="one per model"):
        _named("ties", parameters={"weight": [1, 2, 3]})
    with pytest.raises(RecipeError, match="MAEC inputs"):
        _named("ties", source_control="S")


def test_named_form_of_layer_swap_and_maec() -> None:
    data = _named("layer_swap", base=None, parameters={"bottom_k": 2})
    assert [m["parameters"] for m in data["models"]] == [{"role": "ability"},
                                                         {"role": "language"}]
    assert parse_recipe(data).parameters == {"bottom_k": 2}
    with pytest.raises(RecipeError, match="exactly one ability donor"):
        _named("layer_swap", donors=["A1", "A2"])
    data = _named("maec", donors=["A1", "A2"], source_control="S", ability_corpus="C",
                  parameters={"mu": [0.5, 2], "key_ratio": 0.1})
    recipe = parse_recipe(data)
    assert recipe.method_inputs is not None and recipe.parameters == {"key_ratio": 0.1}
    own = recipe.method_inputs.model_dump()
    assert own["language_base"] == "L"
    assert [(a["model"], a["control"], a["corpus"], a["mu"]) for a in own["abilities"]] == [
        ("A1", "S", "C", 0.5), ("A2", "S", "C", 2.0)]
    with pytest.raises(RecipeError, match="mu"):
        parse_recipe(_named("maec", parameters={"mu": "lots"}))


def test_method_specific_validation_lives_in_its_unit() -> None:
    with pytest.raises(RecipeError, match="role"):
        parse_recipe({"merge_method": "layer_swap", "models": [
            {"model": "a", "parameters": {"role": "language"}},
            {"model": "c", "parameters": {"role": "language"}}]})
    with pytest.raises(RecipeError, match="language_base"):
        parse_recipe({"merge_method": "maec", "base_model": "b",
                      "abilities": [{"model": "a"}]})
    with pytest.raises(RecipeError, match="MAEC fields"):
        parse_recipe({"merge_method": "breadcrumbs", "base_model": "b",
                      "language_base": "l", "models": [{"model": "a"}]})
    with pytest.raises(RecipeError, match="gamma"):
        parse_recipe({"merge_method": "breadcrumbs", "base_model": "b",
                      "models": [{"model": "a", "parameters": {"gamma": 2.0}}]})


def test_recipe_sources_and_with_sources() -> None:
    maec = parse_recipe({
        "merge_method": "maec", "base_model": "s3://b", "language_base": "s3://l",
        "abilities": [{"model": "s3://a", "control": "s3://c", "corpus": "s3://t.jsonl"},
                      {"model": "s3://a2"}],
        "tokenizer_source": "s3://l",
    })
    assert [(s.role, s.ref, s.index, s.kind) for s in maec.sources()] == [
        ("base", "s3://b", None, "checkpoint"),
        ("language_base", "s3://l", None, "checkpoint"),
        ("ability_donor", "s3://a", 0, "checkpoint"),
        ("ability_control", "s3://c", 0, "checkpoint"),
        ("ability_corpus", "s3://t.jsonl", 0, "corpus"),
        ("ability_donor", "s3://a2", 1, "checkpoint"),
        ("tokenizer", "s3://l", None, "tokenizer"),
    ]
    local = {s.ref: f"/cache/{i}" for i, s in enumerate(maec.sources())}
    moved = maec.with_sources(local)
    assert [s.ref for s in moved.sources()] == [local[s.ref] for s in maec.sources()]
    assert moved.method_inputs is not None and moved.parameters == maec.parameters
    assert moved.method_inputs.model_dump()["abilities"][1]["control"] is None
    assert maec.base_model == "s3://b"  # the original is unchanged

    slerp = parse_recipe({"merge_method": "slerp", "base_model": "b",
                          "tokenizer_source": "base",
                          "models": [{"model": "b"}, {"model": "a", "parameters": {}}]})
    assert [(s.role, s.ref, s.index) for s in slerp.sources()] == [
        ("base", "b", None), ("model", "b", 0), ("model", "a", 1)]
    moved = slerp.with_sources({"b": "/x/b"})
    assert moved.base_model == "/x/b" and moved.tokenizer_source == "base"
    assert [m.model for m in moved.models] == ["/x/b", "a"]


def test_a_method_says_what_sweep_candidates_share(
    scratch_registry: dict[str, MergeMethod],
) -> None:
    # A sweep groups candidates by the method's reuse_key, whatever the method: a second
    # extract/combine method gets the grouping (and the reuse) without touching the sweep.
    from maec_core.methods.base import Finite, Params
    from maec_core.sweep.grid import candidates, extraction_groups

    class StrengthParams(Params):
        strength: Finite = 1.0
        scale: Finite = 1.0

    class Shares(TensorMethod):
        name = "shares_for_test"
        paper = "none"
        params = StrengthParams
        needs_base = False

        def merge(self, call: TensorCall) -> Any:
            return call.models[0]

        def reuse_key(self, recipe: Any) -> Any:
            return (("strength", recipe.parameters["strength"]),)

    sets = [{"name": "t", "language": "en", "kind": "perplexity", "path": "t.txt"}]
    recipe = parse_recipe({
        "merge_method": "shares_for_test", "models": [{"model": "a"}], "evaluate": sets,
        "sweep": {"grid": {"strength": [1.0, 2.0], "scale": [0.5, 1.0]},
                  "objective": {"set": "t", "metric": "perplexity"}}})
    cands = candidates(recipe)
    assert [c.group for c in cands] == [(("strength", 1.0),)] * 2 + [(("strength", 2.0),)] * 2
    assert extraction_groups(cands) == 2


def test_a_method_owns_its_top_level_keys(
    scratch_registry: dict[str, MergeMethod], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The shared recipe has no method's fields: a method's inputs model claims its keys,
    # checks them as strictly as the recipe's own, and says where their references sit.
    from maec_core.recipe import inputs as inputs_mod
    from maec_core.recipe.inputs import MethodInputs, SourceRef

    monkeypatch.setattr(inputs_mod, "_INPUTS", dict(inputs_mod._INPUTS))

    class Guides(MethodInputs):
        guide: str | None = None

        def sources(self) -> list[SourceRef]:
            return [] if self.guide is None else [SourceRef("guide", self.guide)]

        def with_sources(self, mapping: Any) -> Guides:
            return self.model_copy(update={"guide": mapping.get(self.guide, self.guide)})

    class Guided(TensorMethod):
        name = "guided_for_test"
        paper = "none"
        inputs = Guides

        def merge(self, call: TensorCall) -> Any:
            return call.models[0]

    recipe = parse_recipe({"merge_method": "guided_for_test", "base_model": "b",
                           "guide": "g", "models": [{"model": "a"}]})
    assert [(s.role, s.ref) for s in recipe.sources()] == [
        ("base", "b"), ("guide", "g"), ("model", "a")]
    assert recipe.with_sources({"g": "/x/g"}).to_yaml().count("guide: /x/g") == 1
    assert not any(w.startswith("guide") for w in recipe.recipe_warnings())
    with pytest.raises(RecipeError, match="invalid recipe: guide: Input should be"):
        parse_recipe({"merge_method": "guided_for_test", "base_model": "b",
                      "guide": {"x": 1}, "models": [{"model": "a"}]})
    # Another method's recipe: the key stays an unknown one (warned about); given with
    # its owner's default, as every recipe.yaml spells it out, it is dropped.
    plain = {"merge_method": "linear", "models": [{"model": "a"}]}
    linear = parse_recipe({**plain, "guide": "g"})
    assert linear.method_inputs is None and linear.model_extra == {"guide": "g"}
    assert any(w.startswith("guide ignored") for w in linear.recipe_warnings())
    defaulted = parse_recipe({**plain, "guide": None})
    assert defaulted.model_extra == {}
    assert defaulted.to_yaml() == parse_recipe(plain).to_yaml()
    assert "guide" not in parse_recipe(plain).to_yaml()  # exclude_none: a None default


def test_the_shared_recipe_has_no_methods_fields() -> None:
    from maec_core.recipe import Recipe
    from maec_core.recipe.inputs import inputs_models, owned_keys

    owned = owned_keys(inputs_models())
    assert {"language_base", "abilities", "artifact"} <= set(owned)  # MAEC's, found
    assert not set(Recipe.model_fields) & set(owned)


def test_the_named_form_is_the_contracts() -> None:
    # Declared once, in the contract: the request takes those fields, the methods read
    # the same ones, and a body's named form is taken over field for field.
    from maec_contract import NAMED_FIELDS, JobRequest

    assert list(NamedForm.model_fields) == list(NAMED_FIELDS)
    assert [f for f in JobRequest.model_fields if f in NAMED_FIELDS] == list(NAMED_FIELDS)
    req = JobRequest(method="maec", base="B", ability_donor="A", language_base="L",
                     source_control="S", ability_corpus="C", parameters={"mu": 2})
    form = NamedForm.of(req)
    assert (form.base, form.ability_donor, form.language_base, form.source_control,
            form.ability_corpus, form.parameters) == ("B", ["A"], "L", "S", "C", {"mu": 2})
    assert NamedForm.of(JobRequest(method="ties", ability_donor=["A"],
                                   language_base="L")).parameters == {}
