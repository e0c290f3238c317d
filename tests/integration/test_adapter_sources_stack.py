"""A LoRA adapter as a donor, over real processes: a task-arithmetic job whose donor is
an adapter folder (in S3, and as a local path) succeeds, and its download equals the
local merge of the same recipe."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import TinyModels
from tests.core.test_lora import make_adapter
from tests.factories import run_recipe
from tests.integration.conftest import Sources
from tests.stack import Stack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def adapter(tiny_models: TinyModels) -> Path:
    """A peft adapter on the tiny base, under the stack's local root; its config names a
    base that does not exist (the service must not look there)."""
    path = tiny_models.root / "adapter-on-base"
    if not path.exists():
        make_adapter(path, tiny_models.base, seed=11)
        cfg = json.loads((path / "adapter_config.json").read_text())
        cfg["base_model_name_or_path"] = "/nonexistent/base"
        (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path


def _recipe(base: str, adapter: str, donor: str) -> dict[str, Any]:
    return {"merge_method": "task_arithmetic", "base_model": base,
            "models": [{"model": adapter, "parameters": {"weight": 0.9}},
                       {"model": donor, "parameters": {"weight": 0.4}}],
            "parameters": {"lambda": 0.8}}


def _served(stack: Stack, job: dict[str, Any], dest: Path) -> dict[str, torch.Tensor]:
    with stack.client() as c:
        r = c.get(f"/v1/jobs/{job['id']}/files/model.safetensors")
    assert r.status_code == 200
    dest.write_bytes(r.content)
    return load_file(str(dest))


@pytest.mark.parametrize("where", ["s3", "local"])
def test_an_adapter_donor_job_matches_the_local_merge(
        stack: Stack, s3_sources: Sources, adapter: Path, tmp_path: Path,
        where: str) -> None:
    m = s3_sources.local
    if where == "s3":
        assert stack.s3 is not None
        ref = stack.s3.upload_folder(adapter, "models/adapter-on-base")
        body = _recipe(s3_sources.base, ref, s3_sources.donor)
    else:
        body = _recipe(str(m.base), str(adapter), str(m.donor))
    job = stack.wait(stack.submit({"recipe": body})["id"])
    assert job["status"] == "succeeded", job["error"]
    served = _served(stack, job, tmp_path / "served.safetensors")
    run_recipe(_recipe(str(m.base), str(adapter), str(m.donor)), tmp_path / "local")
    want = load_file(str(tmp_path / "local" / "model.safetensors"))
    assert sorted(served) == sorted(want)
    for name, t in want.items():
        assert torch.equal(served[name], t), name
