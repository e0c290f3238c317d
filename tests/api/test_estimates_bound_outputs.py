"""The estimate a job is routed by bounds what it writes: one real job of each kind (merge
methods, slices, a vocabulary union, LoRA inputs and outputs, MoE builds, a sweep that
publishes every candidate) is submitted, run by a worker here, and the bytes it published
are compared with the disk the API estimated for it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.storage.local import LocalStorage
from tests.api.conftest import Api
from tests.conformance.moe_suite import A, B
from tests.core.test_lora import make_adapter
from tests.factories import make_extended
from worker.runner import JobRunner

TEXT = "w1 w2 w3 w4 w5 w6 w7 w8\n" * 8
Body = Callable[[Api], dict[str, Any]]


def _named(method: str, **parameters: Any) -> Body:
    return lambda api: api.named(method, parameters=parameters or None)


def _slices(api: Api) -> dict[str, Any]:
    # One checkpoint's layers six times over: the output is six times its input.
    base = str(api.models.base)
    return {"recipe": {"merge_method": "passthrough", "slices": [
        {"sources": [{"model": base, "layer_range": [0, 2]}]} for _ in range(6)]}}


def _vocab_union(api: Api) -> dict[str, Any]:
    m = api.models
    ext = make_extended(api.root / "extra" / "ext", 3, like=m.base, words=["x0", "x1"],
                        added=["<lang>"])
    return {"recipe": {"merge_method": "task_arithmetic", "base_model": str(m.base),
                       "tokenizer_source": "union",
                       "models": [{"model": str(m.donor), "parameters": {"weight": 0.5}},
                                  {"model": str(ext), "parameters": {"weight": 0.5}}]}}


def _lora_input(api: Api) -> dict[str, Any]:
    m = api.models
    adapter = make_adapter(api.root / "extra" / "adapter", m.base, seed=5)
    return {"recipe": {"merge_method": "task_arithmetic", "base_model": str(m.base),
                       "models": [{"model": str(adapter), "parameters": {"weight": 0.8}},
                                  {"model": str(m.donor), "parameters": {"weight": 0.5}}]}}


def _lora_output(api: Api) -> dict[str, Any]:
    m = api.models
    return {"recipe": {"merge_method": "task_arithmetic", "base_model": str(m.base),
                       "models": [{"model": str(m.donor), "parameters": {"weight": 1.0}}],
                       "output": {"format": "lora", "rank": 4}}}


def _moe(api: Api) -> dict[str, Any]:
    m = api.models
    return {"kind": "moe", "recipe": {
        "base_model": str(m.base), "gate_mode": "hidden",
        "experts": [{"source_model": str(m.donor), "positive_prompts": A},
                    {"source_model": str(m.lang), "positive_prompts": B}]}}


def _moe_one_source(api: Api) -> dict[str, Any]:
    # Sixty-four experts copied from one fine-tune: one distinct input, 64 MLP copies.
    m = api.models
    return {"kind": "moe", "recipe": {
        "base_model": str(m.base), "gate_mode": "random",
        "experts": [{"source_model": str(m.donor)} for _ in range(64)]}}


def _moe_shared(api: Api) -> dict[str, Any]:
    # Qwen MoE: sixteen routed experts and a shared one, all from one checkpoint.
    m = api.models
    return {"kind": "moe", "recipe": {
        "base_model": str(m.base), "gate_mode": "random", "architecture": "qwen",
        "experts": [{"source_model": str(m.donor)} for _ in range(16)],
        "shared_experts": [{"source_model": str(m.donor)}]}}


def _sweep(api: Api) -> dict[str, Any]:
    (api.root / "extra" / "wiki.txt").write_text(TEXT)
    sets = [{"name": "wiki-sw", "language": "sw", "kind": "perplexity",
             "path": str(api.root / "extra" / "wiki.txt")}]
    sweep = {"grid": {"weight": [0.0, 0.5, 1.0]}, "publish": "all",
             "objective": {"set": "wiki-sw", "metric": "perplexity"}}
    return api.named("task_arithmetic", evaluate=sets, sweep=sweep)


CASES: dict[str, Body] = {
    "task_arithmetic": _named("task_arithmetic"),
    "linear": _named("linear"),
    "ties": _named("ties", density=0.5),
    "maec": _named("maec", key_ratio=0.1),
    "slices": _slices,
    "vocab_union": _vocab_union,
    "lora_input": _lora_input,
    "lora_output": _lora_output,
    "moe": _moe,
    "moe_64_experts_one_source": _moe_one_source,
    "moe_shared_expert": _moe_shared,
    "sweep_publish_all": _sweep,
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_job_publishes_no_more_than_its_disk_estimate(api: Api, case: str) -> None:
    job = api.submit(CASES[case](api))
    runner = JobRunner(api.settings, api.worker_store(),
                       LocalStorage(api.settings.storage_dir), worker="test")
    runner.run(str(job["id"]))
    done = api.client.get(f"/v1/jobs/{job['id']}", headers=api.auth()).json()
    assert done["status"] == "succeeded", done["error"]
    listed = sum(int(f["size"]) for f in done["result"]["files"])
    estimate: dict[str, int] = dict(job["estimate"])  # type: ignore[call-overload]
    # What storage holds under the job's prefix, counted independently of the listing.
    stored = sum(p.stat().st_size for p in Path(api.settings.storage_dir).rglob("*")
                 if p.is_file() and str(job["id"]) in p.as_posix())
    published = max(listed, stored)
    assert 0 < published <= estimate["disk_bytes"], (case, published, estimate)


def test_an_moe_estimate_grows_with_its_experts_not_its_distinct_inputs(api: Api) -> None:
    m = api.models
    needs: list[dict[str, int]] = []
    for n in (2, 8, 32):
        body: dict[str, object] = {"kind": "moe", "recipe": {
            "base_model": str(m.base), "gate_mode": "random",
            "experts": [{"source_model": str(m.donor)} for _ in range(n)]}}
        needs.append(dict(api.submit(body)["estimate"]))  # type: ignore[call-overload]
    disks = [e["disk_bytes"] for e in needs]
    mems = [e["host_memory_bytes"] for e in needs]
    # Each further expert adds its MLP copy (and router row) to the output.
    assert disks[0] < disks[1] < disks[2], disks
    assert (disks[2] - disks[1]) > 2 * (disks[1] - disks[0]), disks
    assert mems[0] < mems[1] < mems[2], mems

