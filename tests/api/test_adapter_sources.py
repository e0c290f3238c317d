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
from maec_core.job_plan import plan_job
from maec_core.parsing import parse_recipe
from tests.api.conftest import Api
from tests.core.test_lora import make_adapter
from tests.factories import run_recipe
from tests.hostile import write_lora_file
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


def _refused(api: Api, body: dict[str, Any], needle: str) -> None:
    """Refused at submission as an invalid checkpoint, naming ``needle``; nothing queued."""
    r = _post(api, body)
    assert r.status_code == 422, r.text
    assert r.json()["code"] == "invalid_checkpoint"
    assert needle in r.json()["message"]
    assert api.r.llen(QUEUE) == 0


def _served_is_local(api: Api, url: str, recipe: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The served model.safetensors equals the command line's merge of ``recipe``,
    tensor by tensor; returns the local merge's tensors."""
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
    return want


def _stand_ins(tmp_path: Path) -> tuple[Path, Path]:
    """(an adapter folder, a full checkpoint folder): enough for the worker's checks,
    which look at what a folder is, not at its tensors."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text("{}")
    (full / "model.safetensors").write_bytes(b"")
    return adapter, full


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
    want = _served_is_local(api, url, recipe)
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
    _refused(api, {"recipe": _recipe(api, adapter)}, "another base")


def test_an_adapter_as_the_base_itself_is_refused(api: Api) -> None:
    adapter = _make(api)
    body = {"recipe": {**_recipe(api, adapter), "base_model": str(adapter),
                       "models": [{"model": str(api.models.donor),
                                   "parameters": {"weight": 0.5}}]}}
    _refused(api, body, "name its base in the recipe")


def test_the_worker_refuses_an_adapter_without_a_full_base(tmp_path: Path) -> None:
    adapter, full = _stand_ins(tmp_path)

    def recipe(base: str | None, method: str = "task_arithmetic") -> Any:
        data: dict[str, Any] = {"merge_method": method,
                                "models": [{"model": str(adapter)}, {"model": str(full)}]}
        if base is not None:
            data["base_model"] = base
        return parse_recipe(data)

    plan_job(recipe(str(full))).adapters.check()
    with pytest.raises(CheckpointError, match="name its base"):
        plan_job(recipe(str(adapter))).adapters.check()
    with pytest.raises(CheckpointError, match="name its base"):
        plan_job(recipe(None, "linear")).adapters.check()
    # References are checked where the worker fetched them.
    refs = parse_recipe({"merge_method": "task_arithmetic", "base_model": "s3://m/base",
                         "models": [{"model": "s3://m/adapter"}, {"model": "s3://m/full"}]})
    plan = plan_job(refs)
    plan.adapters.check({"s3://m/base": str(full), "s3://m/adapter": str(adapter),
                         "s3://m/full": str(full)})
    with pytest.raises(CheckpointError, match="name its base"):
        plan.adapters.check({"s3://m/base": str(adapter), "s3://m/adapter": str(adapter),
                             "s3://m/full": str(full)})


def test_a_base_plus_adapter_donor_runs_and_matches_the_local_merge(api: Api) -> None:
    """mergekit's ``model: base+adapter``, the adapter on a fine-tune rather than on the
    recipe's base: fetched as two inputs, joined for the merge, named as two in the
    manifest, and the result is the command line's."""
    m = api.models
    adapter = make_adapter(api.root / "extra" / "donor-adapter", m.donor, seed=7)
    joined = f"{m.donor}+{adapter}"
    recipe = {"merge_method": "task_arithmetic", "base_model": str(m.base),
              "models": [{"model": joined, "parameters": {"weight": 0.7}}]}
    jid = str(api.submit({"recipe": recipe})["id"])
    rec = api.worker_store().get(jid)
    assert rec is not None and set(rec.sources) == {str(m.base), str(m.donor), str(adapter)}
    urls, manifest = api.run_published(jid)
    assert set(manifest["inputs"]) == {str(m.base), str(m.donor), str(adapter)}
    assert manifest["recipe"]["models"][0]["model"] == joined
    # What the folder records names the recipe's references, never the worker's copies.
    work = str(api.settings.work_dir)
    for name in ("recipe.yaml", "README.md"):
        text = api.client.get(urls[name], headers=api.auth()).text
        assert work not in text and joined in text, (name, text)
    want = _served_is_local(api, urls["model.safetensors"], recipe)
    # Not vacuous: the adapter changed the donor it was applied to.
    plain = {**recipe, "models": [{"model": str(m.donor), "parameters": {"weight": 0.7}}]}
    run_recipe(plain, api.root / "plain")
    other = load_file(str(api.root / "plain" / "model.safetensors"))
    assert not torch.equal(other["model.layers.0.self_attn.q_proj.weight"],
                           want["model.layers.0.self_attn.q_proj.weight"])


def test_a_base_plus_adapter_reference_needs_an_adapter_after_the_plus(api: Api) -> None:
    m = api.models
    body = {"recipe": {"merge_method": "task_arithmetic", "base_model": str(m.base),
                       "models": [{"model": f"{m.donor}+{m.base}"}]}}
    _refused(api, body, "base+adapter")


def test_the_worker_checks_both_parts_of_a_base_plus_adapter_reference(tmp_path: Path) -> None:
    adapter, full = _stand_ins(tmp_path)

    def plan(ref: str) -> Any:
        return plan_job(parse_recipe({"merge_method": "task_arithmetic",
                                      "base_model": str(full), "models": [{"model": ref}]}))

    good = plan("s3://m/donor+s3://m/adapter")
    assert good.checkpoints == (str(full), "s3://m/donor", "s3://m/adapter")
    local = {str(full): str(full), "s3://m/donor": str(full), "s3://m/adapter": str(adapter)}
    good.adapters.check(local)
    assert good.localised(local).models[0].model == f"{full}+{adapter}"
    for ref in (f"{full}+{full}", f"{adapter}+{adapter}"):
        with pytest.raises(CheckpointError, match="base\\+adapter"):
            plan(ref).adapters.check()
