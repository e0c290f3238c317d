"""The typed job body: every bad value is a 4xx with a stable code before anything is
queued, the values real recipes use stay valid, and the OpenAPI document shows the
per-method parameters.

Regression tests for an outside check's findings: type confusion in the named form's
parameters (500s), malformed per-model shapes, values that passed submission and then
failed in the worker (an overflowing float, an infinite weight stored as null, an include
pattern that selects nothing) and lenient coercions (a string or boolean stored where a
number belongs).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from app.queue import QUEUE
from maec_core.errors import RecipeError
from maec_core.maec.params import MaecParams
from maec_core.methods import all_methods
from maec_core.methods.nearswap import NearSwapParams
from maec_core.methods.params import validated_params
from maec_core.recipe.values import Condition
from tests.api.conftest import Api

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def _post(api: Api, body: Any) -> Any:
    raw = body if isinstance(body, str) else json.dumps(body)
    return api.client.post("/v1/jobs", content=raw,
                           headers={**api.auth(), "content-type": "application/json"})


def _refused(api: Api, body: Any, code: str) -> dict[str, Any]:
    r = _post(api, body)
    assert r.status_code == 422, r.text
    doc = dict(r.json())
    assert doc["code"] == code, doc
    assert api.r.llen(QUEUE) == 0 and not api.r.keys("maec:job:*")
    return doc


def _recipe(api: Api, method: str, models: list[dict[str, Any]],
            **kw: Any) -> dict[str, Any]:
    return {"recipe": {"merge_method": method, "base_model": str(api.models.base),
                       "models": models, **kw}}


# -- type confusion and coercions: a 422 naming the parameter, never a 500 or a store --

@pytest.mark.parametrize("value", ["1.5", True, {"a": 1}, [{"a": 1}, {"b": 2}], None,
                                   [[1.0], "x"], [], "NaN"])
@pytest.mark.parametrize(("method", "key"), [
    ("linear", "weight"), ("ties", "density"), ("slerp", "t"), ("task_arithmetic", "lambda"),
    ("maec", "key_ratio"), ("maec", "mu"), ("dare_linear", "random_seed"),
    ("layer_swap", "bottom_k"), ("breadcrumbs", "gamma"),
])
def test_type_confusion_in_named_parameters(api: Api, method: str, key: str,
                                            value: Any) -> None:
    doc = _refused(api, api.named(method, parameters={key: value}), "invalid_recipe")
    assert key in doc["message"], doc


@pytest.mark.parametrize("params", [
    {"weight": [1.0, [1.0, {"x": 1}]]},          # a per-model list holding an object
    {"weight": [[{"filter": 1, "value": 1}], 1.0]},  # a condition with a numeric filter
    {"weight": [[{"value": 1, "extra": 2}], 1.0]},   # a condition with an unknown key
    {"weight": [[], 1.0]},                        # an empty gradient for one model
    {"normalize": [{"filter": "mlp", "value": {"a": 1}}]},
    {"weight": [1.0] * 300},
])
def test_malformed_per_model_shapes(api: Api, params: dict[str, Any]) -> None:
    _refused(api, api.named("linear", parameters=params), "invalid_recipe")


@pytest.mark.parametrize("models", [
    [{"model": "DONOR", "parameters": {"weight": []}}],  # failed in the worker before
    [{"model": "DONOR", "parameters": {"weight": "2"}}],
    [{"model": "DONOR", "parameters": {"weight": {"a": 1}}}],
    [{"model": "DONOR", "parameters": []}],
])
def test_malformed_recipe_model_parameters(api: Api, models: list[dict[str, Any]]) -> None:
    for m in models:
        m["model"] = str(api.models.donor)
    _refused(api, _recipe(api, "linear", models), "invalid_recipe")


@pytest.mark.parametrize("number", ["1e400", "-1e400", "Infinity", "NaN", "1e308", "2e6"])
def test_overflowing_and_infinite_numbers(api: Api, number: str) -> None:
    # Sent as JSON text: Python's parser turns 1e400 into inf, which the job record
    # used to store as null and the worker then refused.
    body = json.dumps(api.named("linear", parameters={"weight": 0.0})).replace(
        '"weight": 0.0', f'"weight": {number}')
    _refused(api, body, "invalid_recipe")
    body = json.dumps(_recipe(api, "maec", [], language_base=str(api.models.lang),
                              abilities=[{"model": str(api.models.donor), "mu": 0.0}])
                      ).replace('"mu": 0.0', f'"mu": {number}')
    _refused(api, body, "invalid_recipe")


def test_numbers_are_stored_as_numbers(api: Api) -> None:
    job = api.submit(api.named("ties", parameters={"density": 1, "weight": [0.5, 1],
                                                   "lambda": 1, "normalize": False}))
    recipe: Any = job["recipe"]
    assert recipe["parameters"] == {"lambda": 1.0, "normalize": False}
    assert [m["parameters"] for m in recipe["models"]] == [
        {"density": 1.0, "weight": 0.5}, {"density": 1.0, "weight": 1.0}]
    for m in recipe["models"]:
        assert all(type(v) is float for v in m["parameters"].values())


def test_integers_beyond_exact_json_are_refused(api: Api) -> None:
    _refused(api, api.named("dare_linear", parameters={"random_seed": 2**60}),
             "invalid_recipe")
    _refused(api, api.named("layer_swap", base=None, parameters={"bottom_k": 10**30}),
             "invalid_recipe")


# -- regex filters: bounded, and checked against the checkpoint's tensor names --

@pytest.mark.parametrize("pattern", ["(" * 400 + ")" * 400, "a{4294967296}", "[",
                                     "x" * 513])
def test_unusable_include_patterns(api: Api, pattern: str) -> None:
    _refused(api, api.named("maec", parameters={"include": pattern}), "invalid_recipe")
    _refused(api, api.named("maec", parameters={"exclude": [pattern]}), "invalid_recipe")


def test_include_pattern_selecting_nothing(api: Api) -> None:
    doc = _refused(api, api.named("maec", parameters={"include": "no_such_tensor"}),
                   "empty_selection")
    assert "no_such_tensor" in doc["message"]
    doc = _refused(api, api.named("maec", parameters={"include": ["q_proj", "typo_proj"]}),
                   "empty_selection")
    assert doc["details"]["pattern"] == "typo_proj"
    # Each pattern matches, but exclude removes everything include keeps.
    _refused(api, api.named("maec", parameters={"include": "q_proj", "exclude": "layers"}),
             "empty_selection")
    api.submit(api.named("maec", parameters={"include": ["q_proj", r"mlp\.down"]}))


def test_condition_filter_selecting_nothing(api: Api) -> None:
    cond = [{"filter": "self_atn", "value": 0.3}, {"value": 0.5}]
    body = api.named("slerp", base=str(api.models.lang), parameters={"t": cond})
    doc = _refused(api, body, "empty_selection")
    assert "self_atn" in doc["message"]
    models = [{"model": str(api.models.donor),
               "parameters": {"weight": [{"filter": "nope", "value": 1.0}, {"value": 0.5}]}}]
    _refused(api, _recipe(api, "linear", models), "empty_selection")


def test_pattern_search_has_a_time_limit() -> None:
    params = MaecParams.model_validate({"include": r"(x+x+)+y"})
    with pytest.raises(RecipeError, match="longer than"):
        params.is_included("x" * 5000, 2)


# -- values that would fail per tensor in the worker fail at submission --

def test_condition_leaving_a_required_value_unset(api: Api) -> None:
    t = [{"filter": "self_attn", "value": 0.5}]  # nearswap's t has no default
    body = {"recipe": {"merge_method": "nearswap", "base_model": str(api.models.base),
                       "models": [{"model": str(api.models.donor)}], "parameters": {"t": t}}}
    doc = _refused(api, body, "invalid_recipe")
    assert "for tensor" in doc["message"]
    with pytest.raises(RecipeError, match="for tensor"):
        validated_params(NearSwapParams, {"t": [Condition(filter="mlp", value=0.5)]},
                         "model.embed_tokens.weight", 2)


def test_gradient_on_an_integer_parameter(api: Api) -> None:
    _refused(api, api.named("layer_swap", base=None, parameters={"bottom_k": [0, 1]}),
             "invalid_recipe")


# -- what stays valid --

def test_mergekit_recipes_with_filters_and_gradients_are_accepted(api: Api) -> None:
    m = api.models
    t = [{"filter": "self_attn", "value": [0, 0.5, 0.3, 0.7, 1]},
         {"filter": "mlp", "value": [1, 0.5, 0.7, 0.3, 0]}, {"value": 0.5}]
    api.submit({"recipe": {"merge_method": "slerp", "base_model": str(m.base),
                           "models": [{"model": str(m.base)}, {"model": str(m.donor)}],
                           "parameters": {"t": t}, "dtype": "float32"}})
    api.submit({"recipe": {"merge_method": "slerp", "base_model": str(m.base),
                           "models": [{"model": str(m.base)}, {"model": str(m.donor)}],
                           "parameters": {"t": [0, 0.5, 1]}}})
    api.submit(_recipe(api, "ties", [
        {"model": str(m.donor), "parameters": {"density": [1, 0.7, 0.1], "weight": 1}},
        {"model": str(m.lang), "parameters": {"density": 0.5, "weight": [0, 0.3, 0.5]}},
    ], parameters={"normalize": True, "int8_mask": True, "lambda": 1}))
    api.submit(api.named("Linear", parameters={"weight": [[0, 1], 1.0]}))
    api.submit({**api.named("linear"), "ability_donor": str(m.donor), "shard_size": 10**6})


# -- the OpenAPI document --

def test_openapi_body_is_a_union_per_method(api: Api) -> None:
    doc = api.client.get("/openapi.json", headers=api.auth()).json()
    body = doc["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]
    text = json.dumps(body["schema"])
    assert "RecipeJob" in text
    schemas = doc["components"]["schemas"]
    names = {m.name for m in all_methods()}
    named = [s for s in schemas.values() if s.get("discriminator", {}).get("propertyName")
             == "method"]
    recipes = [s for s in schemas.values() if s.get("discriminator", {}).get("propertyName")
               == "merge_method"]
    for fld, holder in (("method", named), ("merge_method", recipes)):
        mapping = (holder[0]["discriminator"] if holder
                   else _find_discriminator(doc, fld))["mapping"]
        assert set(mapping) == names
    ties = schemas["TiesNamedParameters"]["properties"]
    assert ties["density"]["oneOf"][0]["oneOf"][0]["exclusiveMinimum"] == 0.0
    assert schemas["MaecParameters"]["properties"]["key_ratio"]["maximum"] == 1.0
    links = doc["paths"]["/v1/jobs"]["post"]["responses"]["202"]["links"]
    assert links["GetJob"]["parameters"] == {"job_id": "$response.body#/id"}


def _find_discriminator(node: Any, prop: str) -> dict[str, Any]:
    if isinstance(node, dict):
        if node.get("discriminator", {}).get("propertyName") == prop:
            return dict(node["discriminator"])
        for v in node.values():
            found = _find_discriminator(v, prop)
            if found:
                return found
    elif isinstance(node, list):
        for v in node:
            found = _find_discriminator(v, prop)
            if found:
                return found
    return {}


# -- what can still fail in the worker fails with a specific code --

def _run(api: Api, job_id: str) -> dict[str, Any]:
    from app.storage.local import LocalStorage
    from worker.runner import JobRunner

    runner = JobRunner(api.settings, api.worker_store(), LocalStorage(api.settings.storage_dir))
    assert runner.run(job_id) == "failed"
    r = api.client.get(f"/v1/jobs/{job_id}", headers=api.auth())
    return dict(r.json()["error"])


def test_running_out_of_memory_is_its_own_code(api: Api,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import maec_core.service.running

    def no_memory(*_a: Any, **_k: Any) -> None:
        raise MemoryError("cannot allocate")

    monkeypatch.setattr(maec_core.service.running, "run", no_memory)
    job_id = str(api.submit()["id"])
    assert _run(api, job_id)["code"] == "out_of_memory"


def test_a_queued_recipe_failing_per_tensor_is_a_recipe_error(api: Api) -> None:
    # Written to the store directly, as a job queued before these checks existed: the
    # engine's per-tensor validation names the recipe, not an internal error.
    job_id = str(api.submit({"recipe": {
        "merge_method": "nearswap", "base_model": str(api.models.base),
        "models": [{"model": str(api.models.donor)}], "parameters": {"t": 0.5}}})["id"])
    key = f"maec:job:{job_id}"
    stored = api.r.hget(key, "recipe")
    assert isinstance(stored, bytes)
    recipe = json.loads(stored)
    recipe["parameters"] = {"t": [{"filter": "self_attn", "value": 0.5}]}
    api.r.hset(key, "recipe", json.dumps(recipe))
    error = _run(api, job_id)
    assert error["code"] == "invalid_recipe" and "for tensor" in error["message"]


# -- the generator --

def test_a_new_method_gets_its_members_from_its_models() -> None:
    from pydantic import Field, TypeAdapter, ValidationError

    from app.api.job_body import _method_models
    from maec_core.methods.base import Finite, Params, TensorMethod

    class SharpParams(Params):
        alpha: Finite = Field(0.5, ge=0.0, le=2.0)
        steps: int = Field(3, ge=1)

    class Sharp(TensorMethod):  # no ``name`` in its body: not registered
        params = SharpParams

    method = Sharp()
    method.name = "sharp"  # type: ignore[misc]
    named, recipe = _method_models(method)
    ok = TypeAdapter(named).validate_python(
        {"method": "sharp", "ability_donor": ["/a"], "language_base": "/l",
         "parameters": {"alpha": [0, 2], "steps": 4}})
    assert ok.model_dump(exclude_unset=True)["parameters"] == {"alpha": [0.0, 2.0], "steps": 4}
    for bad in ({"alpha": 2.5}, {"alpha": "1"}, {"steps": 1.5}, {"steps": True},
                {"steps": [1, 2]}):
        with pytest.raises(ValidationError):
            TypeAdapter(recipe).validate_python({"merge_method": "sharp", "parameters": bad})
    # A name the method does not read passes the schema (mergekit accepts it); the job
    # record lists it as ignored.
    TypeAdapter(recipe).validate_python({"merge_method": "sharp", "parameters": {"beta": 1}})


def test_an_unknown_field_type_is_refused_when_the_schema_is_built() -> None:
    from app.api.job_body import strict_type

    with pytest.raises(TypeError, match="no strict form"):
        strict_type(set[int])
