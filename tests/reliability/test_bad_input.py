"""Bad input over HTTP: a clear 4xx with a stable code, or a failed job with one; the
service keeps serving throughout.

Every hostile checkpoint of tests/hostile.py is offered as a donor of a real job; the
ones detectable from configs and headers are refused before queueing (422 + code), the
rest (NaN/inf weights) fail in the worker with their code. Pickle payloads never run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.hostile import (
    HOSTILE,
    MAX_BODY_DEPTH,
    Hostile,
    deep_bodies,
    marker_path,
    raw_surrogate_body,
    surrogate_bodies,
)
from tests.reliability import results
from tests.stack import Stack, stack_context

pytestmark = [pytest.mark.faults, pytest.mark.integration]

CORPUS_CAP = 4096
ENV = {"MAEC_MAX_CORPUS_BYTES": str(CORPUS_CAP), "MAEC_MAX_MODELS_PER_JOB": "20",
       "MAEC_RATE_LIMIT_PER_MINUTE": "100000", "MAEC_RATE_LIMIT_BURST": "10000",
       "MAEC_SUBMISSIONS_PER_MINUTE": "100000"}


@pytest.fixture(scope="module")
def st(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[Stack]:
    with stack_context(tmp_path_factory.mktemp("badinput"), None, workers=1,
                       local_roots=[model_root], env=ENV) as stack:
        yield stack


def _post(st: Stack, body: Any) -> httpx.Response:
    """POST a JSON-able body, or raw bytes / a str / a byte iterator as sent."""
    with st.client() as c:
        if isinstance(body, dict):
            return c.post("/v1/jobs", json=body)
        return c.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})


def _still_serving(st: Stack, tiny: dict[str, Path]) -> None:
    with st.client() as c:
        assert c.get("/healthz").status_code == 200
        assert c.get("/v1/jobs", params={"limit": 1}).status_code == 200


def _linear(donor: Path | str, base: Path | str) -> dict[str, Any]:
    return {"method": "linear", "ability_donor": [str(donor)], "language_base": str(base)}


@pytest.mark.parametrize("case", HOSTILE, ids=lambda c: c.name)
def test_hostile_checkpoint_over_http(case: Hostile, st: Stack, tiny: dict[str, Path],
                                      model_root: Path) -> None:
    bad = case.build(tiny["a"], model_root / f"hostile-{case.name}")
    resp = _post(st, _linear(bad, tiny["base"]))
    if case.stage in ("open", "plan"):
        assert resp.status_code == 422, resp.text
        body = resp.json()
        assert body["code"] == case.code, body
        assert set(body) == {"code", "message", "details"}
    else:
        assert resp.status_code == 202, resp.text
        job = st.wait(resp.json()["id"])
        assert job["status"] == "failed"
        assert job["error"]["code"] == case.code, job["error"]
        assert job["result"] is None
    assert not marker_path(bad).exists(), "pickle payload ran"
    _still_serving(st, tiny)
    results.add("hostile_inputs")
    if case.name.endswith("_adapter"):
        results.add("adapters_refused")  # LoRA adapter folders (pickled, DoRA)


def test_source_paths_that_escape_are_refused(st: Stack, tiny: dict[str, Path],
                                              model_root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside-model"
    import shutil

    shutil.copytree(tiny["a"], outside)
    link = model_root / "link-to-outside"
    if not link.exists():
        link.symlink_to(outside)
    base = str(tiny["base"])
    refused = {
        "relative": "models/tiny-a",
        "dotdot": f"{model_root}/../{outside.parent.name}/outside-model",
        "dotdot_inside": f"{model_root}/tiny-a/../tiny-a",
        "symlinked_dir_out": str(link),
        "not_a_root": "/etc",
        "file_url": f"file://{tiny['a']}",
        "http_url": "http://127.0.0.1:1/model",
        "s3_dotdot": "s3://maec-test/../secrets",
        "hub_disabled": "hf://owner/name@" + "a" * 40,
        "nul": f"{tiny['a']}\x00",
        "huge": "/" + "a" * 5000,
    }
    for what, src in refused.items():
        resp = _post(st, _linear(src, base))
        assert resp.status_code == 422, (what, resp.text)
        assert resp.json()["code"] in ("invalid_source", "invalid_request"), (what, resp.text)
    resp = _post(st, _linear(model_root / "does-not-exist", base))
    assert (resp.status_code, resp.json()["code"]) == (422, "source_not_found")
    _still_serving(st, tiny)


def test_oversized_requests_are_413(st: Stack, tiny: dict[str, Path]) -> None:
    big = json.dumps({**_linear(tiny["a"], tiny["base"]), "name": "x" * 2_000_000})
    resp = _post(st, big)
    assert resp.status_code == 413
    assert resp.json()["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit counts streamed bytes
        for _ in range(40):
            yield b" " * 65536

    resp = _post(st, chunks())
    assert resp.status_code == 413
    assert resp.json()["code"] == "request_too_large"
    _still_serving(st, tiny)


@pytest.mark.parametrize(("change", "code"), [
    ({"method": "ties", "base": "BASE", "parameters": {"density": 1.5}}, "invalid_recipe"),
    ({"method": "ties", "base": "BASE", "parameters": {"density": 0}}, "invalid_recipe"),
    ({"method": "linear", "parameters": {"weight": "heavy"}}, "invalid_recipe"),
    ({"method": "slerp", "base": "BASE", "parameters": {"t": 2.0}}, "invalid_recipe"),
    ({"method": "linear", "parameters": {"weight": [1.0, 2.0, 3.0]}}, "invalid_recipe"),
    ({"method": "linear", "shard_size": "1B"}, "invalid_recipe"),
    ({"method": "linear", "dtype": "int8"}, "invalid_request"),
    ({"method": "no_such_method"}, "invalid_recipe"),
    ({"method": "maec", "base": "BASE", "parameters": {"key_ratio": 0}}, "invalid_recipe"),
    ({"method": "maec", "base": "BASE", "parameters": {"key_ratio": 1.01}}, "invalid_recipe"),
    ({"method": "linear", "name": "n" * 201}, "invalid_request"),
], ids=lambda v: json.dumps(v) if isinstance(v, dict) else v)
def test_parameters_out_of_range(change: dict[str, Any], code: str, st: Stack,
                                 tiny: dict[str, Path]) -> None:
    body: dict[str, Any] = {**_linear(tiny["a"], tiny["b"]), **change}
    if body.get("base") == "BASE":
        body["base"] = str(tiny["base"])
    resp = _post(st, body)
    assert resp.status_code == 422, resp.text
    assert resp.json()["code"] == code, resp.text


def test_a_parameter_no_method_knows_is_accepted_and_warned(st: Stack,
                                                            tiny: dict[str, Path]) -> None:
    # mergekit ignores it; here it is accepted too, and said on the job record.
    body = {**_linear(tiny["a"], tiny["b"]), "parameters": {"not_a_parameter": 1}}
    resp = _post(st, body)
    assert resp.status_code == 202, resp.text
    assert resp.json()["warnings"] == [
        "parameters.not_a_parameter ignored: no merge method knows this name"]


def test_too_many_donors(st: Stack, tiny: dict[str, Path], model_root: Path) -> None:
    donors = [f"{model_root}/donor-{i}" for i in range(17)]
    resp = _post(st, {"method": "linear", "ability_donor": donors,
                      "language_base": str(tiny["base"])})
    assert (resp.status_code, resp.json()["code"]) == (422, "invalid_request"), resp.text
    # The recipe form's schema bound (256 models) is far above the service's cap
    # (MAEC_MAX_MODELS_PER_JOB), which refuses it before any source is opened.
    models = [{"model": f"{model_root}/m-{i}", "parameters": {"weight": 1.0}}
              for i in range(25)]
    resp = _post(st, {"recipe": {"merge_method": "linear", "models": models}})
    assert (resp.status_code, resp.json()["code"]) == (422, "invalid_recipe"), resp.text
    assert "at most 20" in resp.json()["message"]


def test_corpus_above_cap(st: Stack, tiny: dict[str, Path], model_root: Path) -> None:
    corpus = model_root / "big-corpus.txt"
    corpus.write_text("w1 w2 w3\n" * (CORPUS_CAP // 9 + 10))
    assert corpus.stat().st_size > CORPUS_CAP
    body = {"method": "maec", "base": str(tiny["base"]), "ability_donor": [str(tiny["a"])],
            "language_base": str(tiny["b"]), "ability_corpus": str(corpus),
            "parameters": {"importance": "gradient"}}
    resp = _post(st, body)
    assert (resp.status_code, resp.json()["code"]) == (422, "invalid_corpus"), resp.text
    small = model_root / "small-corpus.txt"
    small.write_text("w1 w2 w3\n" * 10)
    resp = _post(st, {**body, "ability_corpus": str(small)})
    assert resp.status_code == 202, resp.text  # the cap, not the corpus, refused the first


def test_malformed_bodies(st: Stack, tiny: dict[str, Path]) -> None:
    for raw in (b"{", b"\xff\xfe", b"[]", b"null", b'{"recipe": "x"}', b"1e999999",
                b"[" * 100_000 + b"]" * 100_000, os.urandom(512)):
        resp = _post(st, raw)
        assert resp.status_code == 422, (raw[:20], resp.text)
        assert resp.json()["code"] == "invalid_request"
    _still_serving(st, tiny)


def _forms(tiny: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """One body of each form, with every free-form place it has filled in."""
    base, a, b = (str(tiny[k]) for k in ("base", "a", "b"))
    return {
        "named": {**_linear(a, b), "base": base, "name": "n", "idempotency_key": "k",
                  "parameters": {"weight": 0.5, "unread": {"free": ["form"]}},
                  "evaluate": [{"name": "e", "path": base, "extra": {"x": "y"}}],
                  "sweep": {"grid": {"weight": [0.3, 0.5]}}},
        "recipe": {"recipe": {
            "merge_method": "ties", "base_model": base, "name": "r",
            "models": [{"model": a, "parameters": {
                "weight": [{"filter": "mlp", "value": [0.1, 0.2]}, {"value": 1.0}]}}],
            "parameters": {"density": 0.5, "unread": {"k": "v"}}}},
        "moe": {"kind": "moe", "name": "m", "recipe": {
            "base_model": base, "gate_mode": "hidden", "unread_key": {"k": ["v"]},
            "experts": [{"source_model": a, "positive_prompts": ["w1 w2", "w3"],
                         "negative_prompts": ["w4"], "unread": "x"},
                        {"source_model": b, "positive_prompts": ["w5 w6"]}]}},
    }


def _strings(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(doc, str):
        return [path]
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(
        doc, list) else ()
    return [p for k, v in items for p in _strings(v, (*path, k))]


@pytest.mark.parametrize("form", ["named", "recipe", "moe"])
def test_hostile_bodies_are_refused_before_any_job_exists(st: Stack, tiny: dict[str, Path],
                                                          form: str) -> None:
    """A lone surrogate in each key and string (escaped, and as raw bytes), and nesting
    just past the bound and 300 deep under each object and array: 422 invalid_request,
    no job created, the service still serving (docs/api.md, "Text and nesting")."""
    body = _forms(tiny)[form]
    sent: list[tuple[str, bytes, str]] = [
        (w, json.dumps(v).encode(), "lone UTF-16 surrogate") for w, v in surrogate_bodies(body)]
    sent += [(f"raw bytes {p}", raw_surrogate_body(body, p), "lone UTF-16 surrogate")
             for p in _strings(body)]
    sent += [(f"{w} ({n} deep)", json.dumps(v).encode(), "nested deeper than")
             for n in (MAX_BODY_DEPTH, 300) for w, v in deep_bodies(body, n)]
    with st.client() as c:
        # Ids only: earlier tests' jobs may change status meanwhile.
        before = [j["id"] for j in c.get("/v1/jobs", params={"limit": 100}).json()["jobs"]]
        for where, raw, why in sent:
            resp = c.post("/v1/jobs", content=raw,
                          headers={"Content-Type": "application/json"})
            assert resp.status_code == 422, (where, resp.text)
            doc = resp.json()
            assert doc["code"] == "invalid_request" and why in doc["message"], (where, doc)
            results.add("hostile_bodies")
        after = c.get("/v1/jobs", params={"limit": 100}).json()["jobs"]
        assert [j["id"] for j in after] == before
    _still_serving(st, tiny)


def _hostile_tokenizers() -> dict[str, bytes]:
    """tokenizer.json contents the tokenizers library must refuse (or that lie)."""
    from tests.factories import tiny_tokenizer

    good = json.loads(tiny_tokenizer().backend_tokenizer.to_str())
    gap = json.loads(json.dumps(good))
    gap["model"]["vocab"]["w60"] = 1000  # ids not 0..n-1
    return {
        "unknown_model": b'{"version": "1.0", "model": {"type": "Nope"}}',
        "id_gap": json.dumps(gap).encode(),
        "deep": b'{"a":' * 5000 + b"1" + b"}" * 5000,
        "not_utf8": b'{"model": "\xff\xfe"}',
        "no_model": b"{}",
    }


def test_hostile_tokenizers_in_a_vocabulary_merge(st: Stack, tiny: dict[str, Path],
                                                  model_root: Path) -> None:
    import shutil

    for name, data in _hostile_tokenizers().items():
        bad = model_root / f"hostile-tok-{name}"
        if not bad.exists():
            shutil.copytree(tiny["a"], bad)
        (bad / "tokenizer.json").write_bytes(data)
        body = {"recipe": {"merge_method": "linear", "tokenizer_source": "union",
                           "models": [{"model": str(tiny["base"])}, {"model": str(bad)}]}}
        resp = _post(st, body)
        assert (resp.status_code, resp.json()["code"]) == (422, "invalid_tokenizer"), (
            name, resp.text)
        _still_serving(st, tiny)
        results.add("hostile_tokenizers")
