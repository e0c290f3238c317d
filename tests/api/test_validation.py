"""Every submission problem is refused with its stable code before anything is queued."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.queue import QUEUE
from tests import hostile
from tests.api.conftest import Api


def _refused(api: Api, body: dict[str, Any], code: str, status: int = 422) -> dict[str, Any]:
    r = api.client.post("/v1/jobs", json=body, headers=api.auth())
    assert r.status_code == status, r.text
    doc = r.json()
    assert doc["code"] == code, doc
    assert set(doc) == {"code", "message", "details"} and doc["message"]
    assert api.r.llen(QUEUE) == 0 and not api.r.keys("maec:job:*")
    return dict(doc)


@pytest.mark.parametrize("body", [
    {},
    {"method": "ties"},  # no donors / language base
    {"method": "ties", "ability_donor": [], "language_base": "/x"},
    {"recipe": {"merge_method": "ties"}, "method": "ties"},  # both forms
    {"method": "ties", "ability_donor": ["/x"], "language_base": "/x", "colour": "red"},
    {"method": "ties", "ability_donor": ["/x"], "language_base": "/x", "dtype": "int8"},
    {"method": "ties", "ability_donor": ["/x"], "language_base": "/x",
     "idempotency_key": ""},
    {"method": 5, "ability_donor": ["/x"], "language_base": "/x"},
])
def test_schema_errors(api: Api, body: dict[str, Any]) -> None:
    doc = _refused(api, body, "invalid_request")
    assert doc["details"]["problems"]


def test_malformed_json(api: Api) -> None:
    r = api.client.post("/v1/jobs", content=b"{not json",
                        headers={**api.auth(), "content-type": "application/json"})
    assert r.status_code == 422 and r.json()["code"] == "invalid_request"


@pytest.mark.parametrize(("method", "params", "fragment"), [
    ("no_such_method", {}, "unknown merge_method"),
    ("ties", {"density": 1.5}, "density"),
    ("ties", {"density": [0.5, 0.5, 0.5]}, "one per model"),
    ("slerp", {"t": 2.0}, "t"),
    ("maec", {"key_ratio": 0.0}, "key_ratio"),
    ("maec", {"selection": "threshold"}, "selection_threshold"),
    ("maec", {"mu": [1.0, 2.0]}, "one per model"),
    ("maec", {"nonsense": 1}, "nonsense"),
])
def test_parameter_errors(api: Api, method: str, params: dict[str, Any],
                          fragment: str) -> None:
    doc = _refused(api, api.named(method, parameters=params), "invalid_recipe")
    assert fragment in doc["message"]


def test_unread_parameter_is_accepted_and_listed(api: Api) -> None:
    """A parameter the method does not read is accepted, as mergekit accepts it, and
    the job's record says it was ignored."""
    r = api.client.post("/v1/jobs", json=api.named("ties", parameters={"bogus": 1}),
                        headers=api.auth())
    assert r.status_code == 202, r.text
    assert r.json()["warnings"] == [
        "parameters.bogus ignored: no merge method knows this name"]


def test_unknown_top_level_recipe_key_is_accepted_and_listed(api: Api) -> None:
    """mergekit ignores a top-level key it does not know (a misspelling on a model
    card): the job runs, and its record names the key as ignored."""
    m = api.models
    recipe = {"merge_method": "task_arithmetic", "base_model": str(m.base),
              "models": [{"model": str(m.donor)}], "dtpye": "bfloat16"}
    r = api.client.post("/v1/jobs", json={"recipe": recipe}, headers=api.auth())
    assert r.status_code == 202, r.text
    assert r.json()["warnings"] == [
        "dtpye ignored: not a recipe field (mergekit 0.1.5 ignores it too)"]


def test_recipe_form_errors(api: Api) -> None:
    m = api.models
    _refused(api, {"recipe": {"merge_method": "ties", "base_model": str(m.base),
                              "models": [], "typo_key": 1}}, "invalid_recipe")
    _refused(api, {"recipe": {"merge_method": "ties", "models": [{"model": str(m.donor)}]}},
             "invalid_recipe")
    _refused(api, {"recipe": {"merge_method": "maec", "base_model": str(m.base),
                              "language_base": str(m.lang),
                              "abilities": [{"model": str(m.donor)}],
                              "artifact": "/tmp/x"}}, "invalid_recipe")
    _refused(api, api.named("ties", source_control=str(m.control)), "invalid_recipe")


def test_gradient_importance_needs_a_corpus(api: Api) -> None:
    _refused(api, api.named("maec", parameters={"importance": "gradient"}), "invalid_corpus")


def test_missing_corpus_file(api: Api) -> None:
    body = api.named("maec", parameters={"importance": "gradient"},
                     ability_corpus=str(api.models.root / "nope.jsonl"))
    _refused(api, body, "source_not_found")


@pytest.mark.parametrize("source", [
    "relative/path",
    "/etc",                      # outside every allowed root
    "{root}/../../etc",          # escapes with ..
    "http://example.com/model",  # arbitrary URLs
    "file:///etc/passwd",
    "hf://meta-llama/Llama-3-8B@" + "a" * 40,  # hub disabled
    "s3://bucket-name/prefix",   # local storage: no S3 store configured
    "s3://Bad_Bucket/prefix",
    "s3://bucket-name/a/../b",
    "",
])
def test_invalid_sources(api: Api, source: str) -> None:
    src = source.format(root=api.models.root)
    doc = _refused(api, api.named(ability_donor=[src]), "invalid_source")
    assert doc["message"]


@pytest.mark.parametrize(("field", "code"), [
    ("language_base", "invalid_source"), ("source_control", "invalid_source"),
    ("base", "invalid_recipe"),  # an empty base is "no base", which the method needs
])
def test_empty_source_strings(api: Api, field: str, code: str) -> None:
    method = "maec" if field == "source_control" else "task_arithmetic"
    _refused(api, api.named(method, **{field: ""}), code)


def test_symlink_escaping_its_root_is_refused(api: Api, tmp_path: Path) -> None:
    link = api.root / "extra" / "sneaky"
    link.symlink_to("/etc")
    _refused(api, api.named(ability_donor=[str(link)]), "invalid_source")


def test_hub_sources_need_a_pinned_revision(api_factory: Callable[..., Api]) -> None:
    api = api_factory(hub_enabled=True)
    for src in ("hf://owner/model", "hf://owner/model@main", "hf://owner/model@abc123",
                "hf://owner/model@" + "A" * 40):
        doc = _refused(api, api.named(ability_donor=[src]), "invalid_source")
        assert "pinned" in doc["message"] or "expected" in doc["message"]


def test_missing_local_source(api: Api) -> None:
    _refused(api, api.named(ability_donor=[str(api.models.root / "nope")]),
             "source_not_found")


@pytest.mark.parametrize(("case", "code"), [
    (hostile.pickle_only, "pickle_refused"),
    (hostile.truncated, "corrupt_checkpoint"),
    (hostile.header_not_json, "corrupt_checkpoint"),
    (hostile.quantized_int8, "unsupported_dtype"),
    (hostile.vocab_mismatch, "incompatible_checkpoints"),
    (hostile.mismatched_shapes, "incompatible_checkpoints"),
])
def test_bad_checkpoints(api: Api, case: Callable[[Path, Path], Path], code: str) -> None:
    bad = case(api.models.donor, api.root / "extra" / case.__name__)
    _refused(api, api.named(ability_donor=[str(bad)]), code)
    assert not hostile.marker_path(bad).exists()


def test_maec_checks_every_checkpoint(api: Api) -> None:
    bad = hostile.vocab_mismatch(api.models.control, api.root / "extra" / "ctl")
    doc = _refused(api, api.named("maec", source_control=str(bad)), "incompatible_checkpoints")
    assert "vocab" in doc["message"]
