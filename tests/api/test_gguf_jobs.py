"""GGUF through the service: a job merging a GGUF source (a file, a folder holding one,
a job's own GGUF output) with a q8_0 GGUF output, and the typed refusals at submission
from the header alone."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import gguf

from tests.api.conftest import Api
from tests.gguf_factory import CHAT_TEMPLATE, foreign_gguf, sparse_gguf, tiny_gguf, tiny_hf
from tests.ui.test_pages import _login


def _recipe(base: Path, model: str, **output: str) -> dict[str, object]:
    doc: dict[str, object] = {
        "merge_method": "task_arithmetic", "base_model": str(base), "dtype": "float32",
        "models": [{"model": model, "parameters": {"weight": 0.5}}]}
    if output:
        doc["output"] = output
    return doc


def test_a_gguf_source_merges_and_a_q8_0_gguf_is_published(api: Api) -> None:
    extra = api.root / "extra"
    base = tiny_hf(extra / "base", seed=0)
    other = tiny_hf(extra / "other", seed=1, like=base)
    (extra / "gg").mkdir()
    source = tiny_gguf(other, extra / "gg" / "other.Q8_0.gguf")
    r = api.client.post("/v1/jobs", json={"recipe": _recipe(base, str(source), gguf="q8_0")},
                        headers=api.auth())
    assert r.status_code == 202, r.text
    jid = str(r.json()["id"])
    assert any("Q8_0 GGUF file" in w and "lossy" in w for w in r.json()["warnings"])
    rec = api.worker_store().get(jid)
    assert rec is not None and rec.sources[str(source)]["files"][0]["name"] == source.name
    urls, manifest = api.run_published(jid)
    entry = next(f for f in manifest["files"] if f["path"] == "model-q8_0.gguf")
    body = api.client.get(urls["model-q8_0.gguf"], headers=api.auth()).content
    assert hashlib.sha256(body).hexdigest() == entry["sha256"] and len(body) == entry["size"]
    want = hashlib.sha256(source.read_bytes()).hexdigest()
    assert manifest["gguf_inputs"][str(source)]["sha256"] == want
    assert manifest["gguf_inputs"][str(source)]["quantization"] == "Q8_0"
    assert str(api.settings.work_dir) not in json.dumps(manifest)
    # Dequantized once, into an entry of the input cache named by the file's sha256.
    entries = [p for p in api.settings.work_dir.rglob(f"gguf-{want}") if p.is_dir()]
    assert len(entries) == 1 and entries[0].parent.name == "objects"
    out = api.root / "out.gguf"
    out.write_bytes(body)
    reader = gguf.GGUFReader(out)
    assert reader.get_field("tokenizer.chat_template").contents() == CHAT_TEMPLATE
    inputs = json.loads(reader.get_field("maec.inputs").contents())
    assert set(inputs) == {str(base), str(source)}  # named by reference, with digests
    sources = json.loads(reader.get_field("maec.gguf_sources").contents())
    assert sources[str(source)]["sha256"] == want
    _login(api)  # the jobs page lists it with its checksum, downloadable
    page = api.client.get(f"/ui/jobs/{jid}").text
    assert f'data-sha256="{entry["sha256"]}" class="file">model-q8_0.gguf' in page

    # The published GGUF is a source too (job:<id>/<file>), and so is a folder holding one.
    again = api.client.post("/v1/jobs", json={"recipe": _recipe(
        base, f"job:{jid}/model-q8_0.gguf")}, headers=api.auth())
    assert again.status_code == 202, again.text
    api.run_published(str(again.json()["id"]))
    folder = api.client.post("/v1/jobs", json={"recipe": _recipe(base, str(extra / "gg"))},
                             headers=api.auth())
    assert folder.status_code == 202, folder.text


def test_bad_gguf_sources_are_refused_at_submission(api: Api) -> None:
    extra = api.root / "extra"
    base = tiny_hf(extra / "base", seed=0)
    other = tiny_hf(extra / "other", seed=1, like=base)
    good = tiny_gguf(base, extra / "good.gguf")
    cut = extra / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-64])
    bert = foreign_gguf(extra / "bert.gguf")
    pair = extra / "pair"
    pair.mkdir()
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(good, pair / name)
    cases = [(str(extra / "missing.gguf"), {}, "source_not_found"),
             (str(cut), {}, "invalid_gguf"), (str(bert), {}, "unsupported_gguf"),
             (str(pair), {}, "unsupported_gguf"),
             (str(good), {"gguf": "q4_k_m"}, "unsupported_gguf_output"),
             (str(other), {"gguf": "q3_k"}, "unsupported_gguf_output")]
    for model, output, code in cases:
        r = api.client.post("/v1/jobs", json={"recipe": _recipe(base, model, **output)},
                            headers=api.auth())
        assert r.status_code == 422 and r.json()["code"] == code, (model, r.text)


def test_a_pool_refuses_a_gguf_it_cannot_dequantize(api_factory: object) -> None:
    # 2 GiB of host memory holds the tiny GGUF, not a 512M-parameter one (~6 GiB in
    # float32 three times over), which is refused from its header before any download.
    api: Api = api_factory(pools={"cpu": {"host_memory_gib": 2, "disk_gib": 100}},  # type: ignore[operator]
                           worker_pool="cpu")
    extra = api.root / "extra"
    base = tiny_hf(extra / "base", seed=0)
    small = tiny_gguf(base, extra / "small.gguf")
    big = sparse_gguf(extra / "big.gguf", 512 << 20)
    ok = api.client.post("/v1/jobs", json={"recipe": _recipe(base, str(small))},
                         headers=api.auth())
    assert ok.status_code == 202, ok.text
    r = api.client.post("/v1/jobs", json={"recipe": _recipe(base, str(big))},
                        headers=api.auth())
    assert r.status_code == 422 and r.json()["code"] == "no_capable_worker", r.text
    assert r.json()["details"]["need"]["host_memory_bytes"] > 6 * (1 << 30)


def test_a_named_job_asks_for_a_gguf_output_in_its_body(api: Api) -> None:
    extra = api.root / "extra"
    base = tiny_hf(extra / "base", seed=0)
    donor = tiny_hf(extra / "donor", seed=1, like=base)
    lang = tiny_hf(extra / "lang", seed=2, like=base)
    named = {"method": "task_arithmetic", "base": str(base), "ability_donor": [str(donor)],
             "language_base": str(lang), "dtype": "float32"}
    # The same typed refusal as a recipe's output, before anything is queued.
    bad = api.client.post("/v1/jobs", json={**named, "output": {"gguf": "q4_k_m"}},
                          headers=api.auth())
    assert bad.status_code == 422 and bad.json()["code"] == "unsupported_gguf_output"
    both = api.client.post("/v1/jobs", json={"recipe": _recipe(base, str(donor), gguf="f16"),
                                             "output": {"gguf": "q8_0"}}, headers=api.auth())
    assert both.status_code == 422 and both.json()["code"] == "invalid_recipe"
    jid = str(api.submit({**named, "output": {"gguf": "q8_0"}})["id"])
    urls, manifest = api.run_published(jid)
    entry = next(f for f in manifest["files"] if f["path"] == "model-q8_0.gguf")
    assert manifest["gguf"]["file"] == "model-q8_0.gguf"
    body = api.client.get(urls["model-q8_0.gguf"], headers=api.auth()).content
    assert hashlib.sha256(body).hexdigest() == entry["sha256"]
