"""LoRA adapter folders as sources: accepted when the recipe names their base, checked
from headers at submission (shapes against that base's), fetched by the worker with
their config, and never applied to the base their own config names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from app.queue import QUEUE
from app.storage.local import LocalStorage
from maec_core.errors import CheckpointError
from maec_core.parsing import parse_recipe
from tests.api.conftest import Api
from tests.core.test_lora import make_adapter
from tests.factories import run_recipe
from tests.hostile import write_lora_file
from worker.inputs import check_adapter_bases
from worker.runner import JobRunner


def _make(api: Api, name: str = "adapter", seed: int = 5) -> Path:
    path = make_adapter(api.root / "extra" / name, api.models.base, seed=seed)
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(api.root / "elsewhere")  # never followed
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path


def _recipe(api: Api, adapter: Path, **kw: Any) -> dict[str, Any]:
    m = api.models
    return {"merge_method": "task_arithmetic", "base_model": str(m.base),
            "models": [{"model": str(adapter), "parameters": {"weight": 0.8}},
                       {"model": str(m.donor), "parameters": {"weight": 0.5}}], **kw}


def _post(api: Api, body: dict[str, Any]) -> Any:
    return api.client.post("/v1/jobs", json=body, headers=api.auth())


def test_an_adapter_donor_runs_and_matches_the_local_merge(api: Api) -> None:
    adapter = _make(api)
    recipe = _recipe(api, adapter)
    jid = str(api.submit({"recipe": recipe})["id"])
    rec = api.worker_store().get(jid)
    assert rec is not None
    pinned = {f["name"] for f in rec.sources[str(adapter)]["files"]}
    assert pinned == {"adapter_config.json", "adapter_model.safetensors"}
    runner = JobRunner(api.settings, api.worker_store(), LocalStorage(api.settings.storage_dir),
                       worker="test")
    assert runner.run(jid) == "succeeded"
    job = api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json()
    url = {f["path"]: f["url"] for f in job["result"]["files"]}["model.safetensors"]
    got = api.client.get(url, headers=api.auth())
    assert got.status_code == 200
    out = api.root / "served.safetensors"
    out.write_bytes(got.content)
    run_recipe(recipe, api.root / "local")
    want = load_file(str(api.root / "local" / "model.safetensors"))
    served = load_file(str(out))
    assert sorted(served) == sorted(want)
    for name, t in want.items():
        assert torch.equal(served[name], t), name
    # The adapter changed what it targets: not the merge of the base alone.
    plain = {**recipe, "models": [{"model": str(api.models.base),
                                   "parameters": {"weight": 0.8}}, recipe["models"][1]]}
    run_recipe(plain, api.root / "plain")
    other = load_file(str(api.root / "plain" / "model.safetensors"))
    assert not torch.equal(other["model.layers.0.self_attn.q_proj.weight"],
                           want["model.layers.0.self_attn.q_proj.weight"])


def test_an_adapter_for_another_base_is_refused_from_its_headers(api: Api) -> None:
    adapter = api.root / "extra" / "wide"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 2, "lora_alpha": 2, "target_modules": ["q_proj"]}))
    write_lora_file(adapter, [2, 48], [48, 2])  # the tiny base's q_proj is not 48 wide
    r = _post(api, {"recipe": _recipe(api, adapter)})
    assert r.status_code == 422, r.text
    assert r.json()["code"] == "invalid_checkpoint"
    assert "another base" in r.json()["message"]
    assert api.r.llen(QUEUE) == 0


def test_an_adapter_as_the_base_itself_is_refused(api: Api) -> None:
    adapter = _make(api)
    body = {"recipe": {**_recipe(api, adapter), "base_model": str(adapter),
                       "models": [{"model": str(api.models.donor),
                                   "parameters": {"weight": 0.5}}]}}
    r = _post(api, body)
    assert r.status_code == 422, r.text
    assert r.json()["code"] == "invalid_checkpoint"
    assert "name its base in the recipe" in r.json()["message"]
    assert api.r.llen(QUEUE) == 0


def test_the_worker_refuses_an_adapter_without_a_full_base(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text("{}")
    (full / "model.safetensors").write_bytes(b"")

    def recipe(base: str | None, method: str = "task_arithmetic") -> Any:
        data: dict[str, Any] = {"merge_method": method,
                                "models": [{"model": str(adapter)}, {"model": str(full)}]}
        if base is not None:
            data["base_model"] = base
        return parse_recipe(data)

    check_adapter_bases(recipe(str(full)))
    with pytest.raises(CheckpointError, match="name its base"):
        check_adapter_bases(recipe(str(adapter)))
    with pytest.raises(CheckpointError, match="name its base"):
        check_adapter_bases(recipe(None, "linear"))
