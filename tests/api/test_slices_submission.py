"""Slices recipes at submission: planned from headers, a bad layer_range refused as a 422."""

from __future__ import annotations

import json

from app.queue import QUEUE
from app.storage.local import LocalStorage
from tests.api.conftest import Api
from worker.runner import JobRunner


def _passthrough(api: Api, *ranges: tuple[str, int, int]) -> dict[str, object]:
    return {"recipe": {
        "merge_method": "passthrough",
        "slices": [{"sources": [{"model": m, "layer_range": [lo, hi]}]} for m, lo, hi in ranges],
    }}


def _run_to_config(api: Api, jid: str) -> dict[str, object]:
    """Run job ``jid`` on a worker here; the published config.json."""
    runner = JobRunner(api.settings, api.worker_store(), LocalStorage(api.settings.storage_dir),
                       worker="test")
    assert runner.run(jid) == "succeeded"
    job = api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json()
    url = next(f["url"] for f in job["result"]["files"] if f["path"] == "config.json")
    config: dict[str, object] = json.loads(api.client.get(url, headers=api.auth()).content)
    return config


def test_layer_range_past_the_layers_is_refused_before_queueing(api: Api) -> None:
    m = api.models  # two-layer checkpoints
    body = _passthrough(api, (str(m.base), 0, 2), (str(m.donor), 1, 3))
    r = api.client.post("/v1/jobs", json=body, headers=api.auth())
    assert r.status_code == 422, r.text
    doc = r.json()
    assert doc["code"] == "invalid_recipe"
    assert "slices[1].sources[0]: layer_range [1, 3] exceeds the 2 layers" in doc["message"]
    assert api.r.llen(QUEUE) == 0 and not api.r.keys("maec:job:*")


def test_a_frankenmerge_is_accepted(api: Api) -> None:
    m = api.models
    job = api.submit(_passthrough(api, (str(m.base), 0, 2), (str(m.donor), 1, 2)))
    assert job["status"] == "queued"
    assert api.r.llen(QUEUE) == 1


def test_a_frankenmerge_job_runs_to_a_deeper_model(api: Api) -> None:
    # The worker fetches the slice sources and rewrites them to local copies.
    m = api.models
    jid = str(api.submit(_passthrough(api, (str(m.base), 0, 2), (str(m.donor), 0, 2)))["id"])
    config = _run_to_config(api, jid)
    assert config["num_hidden_layers"] == 4


def test_a_vlm_modules_job_runs_and_a_bad_module_is_refused(api: Api) -> None:
    """mergekit's modules: shape through the service: planned at submission (a module the
    architecture lacks is a 422 before queueing), fetched and merged by the worker."""
    from tests.conformance.models import make_model

    base = make_model(api.root / "extra" / "vlm-base", "mistral3", seed=0)
    donor = make_model(api.root / "extra" / "vlm-a", "mistral3", seed=1, like=base)
    bad = {"recipe": {"merge_method": "linear",
                      "modules": {"audio_tower": {"models": [{"model": str(base)}]}}}}
    r = api.client.post("/v1/jobs", json=bad, headers=api.auth())
    assert r.status_code == 422, r.text
    assert r.json()["code"] == "invalid_recipe" and "audio_tower" in r.json()["message"]
    assert api.r.llen(QUEUE) == 0
    body = {"recipe": {"merge_method": "passthrough", "modules": {
        "text_decoder": {"slices": [
            {"sources": [{"model": str(base), "layer_range": [0, 6]}]},
            {"sources": [{"model": str(donor), "layer_range": [4, 6]}]}]},
        "vision_tower": {"models": [{"model": str(donor)}]},
        "multi_modal_projector": {"models": [{"model": str(base)}]}}}}
    jid = str(api.submit(body)["id"])
    config = _run_to_config(api, jid)
    text = config["text_config"]
    assert isinstance(text, dict) and text["num_hidden_layers"] == 8
