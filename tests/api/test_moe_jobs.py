"""MoE builds as jobs: ``{"kind": "moe", "recipe": <mergekit-moe config>}`` is planned
from headers at submission (refusals are 4xx before anything is queued), built by the
worker and published like a merge; the published tensors are mergekit-moe's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load, load_file, save_file

from app.queue import QUEUE
from app.storage.local import LocalStorage
from tests.api.conftest import Api
from tests.conformance.moe_suite import A, B, run_mergekit, tensors
from worker.runner import JobRunner


def _moe(api: Api, **top: Any) -> dict[str, Any]:
    m = api.models
    return {"kind": "moe", "recipe": {
        "base_model": str(m.base), "gate_mode": "hidden",
        "experts": [{"source_model": str(m.donor), "positive_prompts": A},
                    {"source_model": str(m.lang), "positive_prompts": B}], **top}}


def _run(api: Api, jid: str) -> dict[str, Any]:
    runner = JobRunner(api.settings, api.worker_store(),
                       LocalStorage(api.settings.storage_dir), worker="test")
    runner.run(jid)
    return dict(api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json())


def test_an_moe_job_publishes_mergekit_moes_tensors(api: Api, tmp_path: Path) -> None:
    body = _moe(api, dtype="bfloat16", tokenizer_source="base")
    job = api.submit(body)
    assert job["method"] == "moe" and job["status"] == "queued"
    done = _run(api, str(job["id"]))
    assert done["status"] == "succeeded", done["error"]
    files = {f["path"]: f["url"] for f in done["result"]["files"]}
    assert {"model.safetensors", "config.json", "moe_config.yaml", "manifest.json",
            "tokenizer.json"} <= set(files)
    report = done["result"]["report"]
    assert report["architecture"] == "mixtral" and report["experts"] == 2
    # A key mergekit-moe does not read: accepted, and said on the job record.
    assert report["warnings"] == ["tokenizer_source: not read by mergekit-moe, ignored"]
    assert done["warnings"] == report["warnings"]
    # The manifest names the base and experts by the config's references, no worker path.
    manifest = api.client.get(files["manifest.json"], headers=api.auth()).json()
    assert manifest == done["result"]["manifest"]
    api.assert_named_by_reference(
        manifest, {str(api.models.base), str(api.models.lang), str(api.models.donor)})
    ours = load(api.client.get(files["model.safetensors"], headers=api.auth()).content)
    theirs_dir = tmp_path / "mergekit"
    assert run_mergekit(body["recipe"], theirs_dir)
    theirs = tensors(theirs_dir)
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name
    # The jobs page names the build's base and experts.
    from tests.ui.test_pages import _login

    _login(api)
    page = api.client.get("/ui/jobs").text
    assert str(api.models.lang) in page and str(api.models.donor) in page


def _refused(api: Api, body: dict[str, Any], status: int, code: str) -> str:
    r = api.client.post("/v1/jobs", json=body, headers=api.auth())
    assert r.status_code == status, r.text
    assert r.json()["code"] == code, r.text
    assert api.r.llen(QUEUE) == 0
    return str(r.json()["message"])


def test_bad_moe_configs_are_refused_before_queueing(api: Api, tmp_path: Path) -> None:
    assert "gate_mode" in _refused(api, _moe(api, gate_mode="sideways"), 422,
                                   "invalid_recipe")
    assert "experts_per_token" in _refused(api, _moe(api, experts_per_token=3), 422,
                                           "invalid_recipe")
    # mergekit-moe would make a DeepSeek MoE of this: not built here, said by name.
    shared = _moe(api)
    shared["recipe"]["shared_experts"] = [{"source_model": str(api.models.control)}]
    assert "DeepSeek MoE" in _refused(api, shared, 422, "unsupported_moe")
    pickled = tmp_path / "extra" / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((api.models.donor / "config.json").read_text())
    torch.save({"x": torch.zeros(1)}, pickled / "pytorch_model.bin")
    body = _moe(api)
    body["recipe"]["experts"][1]["source_model"] = str(pickled)
    _refused(api, body, 422, "pickle_refused")
    outside = _moe(api)
    outside["recipe"]["base_model"] = "/etc"
    _refused(api, outside, 422, "invalid_source")
    # The MoE form takes no evaluation or sweep.
    _refused(api, {**_moe(api), "sweep": {"grid": {}}}, 422, "invalid_request")


def test_a_failed_moe_job_publishes_nothing(api: Api, tmp_path: Path) -> None:
    nan = tmp_path / "extra" / "nan"
    nan.mkdir()
    for f in api.models.lang.iterdir():
        (nan / f.name).write_bytes(f.read_bytes())
    weights = load_file(nan / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"][0, 0] = float("inf")
    save_file(weights, nan / "model.safetensors", metadata={"format": "pt"})
    body = _moe(api, gate_mode="cheap_embed")
    body["recipe"]["experts"][1]["source_model"] = str(nan)
    done = _run(api, str(api.submit(body)["id"]))
    assert done["status"] == "failed"
    assert done["error"]["code"] == "non_finite_output"
    assert not list((api.settings.storage_dir / "jobs").rglob("*.safetensors"))
