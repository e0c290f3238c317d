"""LoRA through the service: a recipe's ``output: {format: lora}`` is checked at
submission and published by the worker as a PEFT adapter; an adapter source is refused
before queueing when the recipe names no base (its base would only be named inside the
adapter)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from app.queue import QUEUE
from app.storage.local import LocalStorage
from tests.api.conftest import Api
from tests.hostile import write_lora_file
from worker.runner import JobRunner


def _recipe(api: Api, output: dict[str, Any]) -> dict[str, Any]:
    m = api.models
    return {"recipe": {
        "merge_method": "task_arithmetic", "base_model": str(m.base),
        "models": [{"model": str(m.donor), "parameters": {"weight": 1.0}}],
        "output": output,
    }}


def test_a_lora_output_job_publishes_an_adapter(api: Api) -> None:
    jid = str(api.submit(_recipe(api, {"format": "lora", "rank": 4}))["id"])
    runner = JobRunner(api.settings, api.worker_store(), LocalStorage(api.settings.storage_dir),
                       worker="test")
    assert runner.run(jid) == "succeeded"
    job = api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json()
    files = {f["path"]: f["url"] for f in job["result"]["files"]}
    assert {"adapter_model.safetensors", "adapter_config.json", "lora_report.json",
            "manifest.json"} <= set(files)
    assert "model.safetensors" not in files
    config = json.loads(api.client.get(files["adapter_config.json"], headers=api.auth()).content)
    assert config["peft_type"] == "LORA" and config["r"] == 4
    # The adapter and its recipe name the base as submitted, never the worker's copy.
    assert config["base_model_name_or_path"] == str(api.models.base)
    recipe = api.client.get(files["recipe.yaml"], headers=api.auth()).text
    assert str(api.models.base) in recipe
    assert str(api.settings.work_dir) not in recipe + json.dumps(config)
    summary = job["result"]["report"]["lora"]
    assert summary["rank"] == 4 and summary["modules"] > 0
    assert 0.0 < summary["retained_energy_min"] <= 1.0


def test_a_lora_output_without_a_rank_is_refused_before_queueing(api: Api) -> None:
    r = api.client.post("/v1/jobs", json=_recipe(api, {"format": "lora"}), headers=api.auth())
    assert r.status_code == 422, r.text
    assert r.json()["code"] == "invalid_recipe" and "needs a rank" in r.json()["message"]
    assert api.r.llen(QUEUE) == 0


def test_an_adapter_source_with_its_base_named_only_inside_is_refused(
        api: Api, tmp_path: Path) -> None:
    adapter = tmp_path / "extra" / "adapter"
    adapter.mkdir()
    # Its base is outside the allowed roots: following it would read past them.
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 2, "lora_alpha": 2, "target_modules": ["q_proj"],
        "base_model_name_or_path": str(tmp_path / "elsewhere")}))
    write_lora_file(adapter, [2, 32], [32, 2])
    # linear takes no base_model: nothing in the recipe says what the adapter applies to.
    body = {"recipe": {"merge_method": "linear", "models": [
        {"model": str(adapter), "parameters": {"weight": 0.5}},
        {"model": str(api.models.donor), "parameters": {"weight": 0.5}}]}}
    r = api.client.post("/v1/jobs", json=body, headers=api.auth())
    assert r.status_code == 422, r.text
    assert r.json()["code"] == "invalid_checkpoint"
    assert "name its base in the recipe" in r.json()["message"]
    assert api.r.llen(QUEUE) == 0
