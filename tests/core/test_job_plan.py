"""A job's plan (what it reads, its stage spans, its adapter check) and its progress
arithmetic, decided once from the recipe, without torch."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from maec_core.errors import CheckpointError
from maec_core.job_plan import plan_job, published_manifest
from maec_core.job_progress import candidate_at, job_spans
from maec_core.manifest import build_manifest
from maec_core.parsing import parse_recipe

ROOT = Path(__file__).resolve().parents[2]
SETS = [{"name": "qa", "language": "sw", "kind": "accuracy", "path": "s3://e/qa.jsonl",
         "few_shot": {"path": "s3://e/shots.jsonl", "k": 1, "language": "source"}}]
OBJECTIVE = {"set": "qa", "metric": "accuracy"}


def _maec(**kw: object) -> dict[str, object]:
    return {"merge_method": "maec", "base_model": "s3://m/base",
            "language_base": "hf://org/lang@abc",
            "abilities": [{"model": "local://donor"}], **kw}


def test_the_plan_imports_without_torch() -> None:
    code = ("import json, sys; import maec_core.job_plan; "
            "print(json.dumps(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('torch', 'transformers'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert json.loads(out.stdout) == []


def test_the_plan_names_every_input_once_and_how_it_is_read() -> None:
    plan = plan_job(parse_recipe(_maec(evaluate=SETS)))
    assert plan.checkpoints == ("s3://m/base", "hf://org/lang@abc", "local://donor")
    assert plan.eval_inputs == ("s3://e/qa.jsonl", "s3://e/shots.jsonl")
    assert plan.inputs == (*plan.checkpoints, *plan.eval_inputs)
    assert [plan.one_file(r) for r in plan.inputs] == [False, False, False, True, True]
    local = {ref: f"/w/inputs/{i}" for i, ref in enumerate(plan.inputs)}
    moved = plan.localised(local)
    assert [s.ref for s in moved.sources()] == ["/w/inputs/0", "/w/inputs/1", "/w/inputs/2"]
    assert moved.evaluate is not None and moved.evaluate[0].path == "/w/inputs/3"
    assert moved.evaluate[0].few_shot is not None
    assert moved.evaluate[0].few_shot.path == "/w/inputs/4"
    # The plan's recipe stays the one submitted.
    assert plan.recipe.base_model == "s3://m/base"


def test_stage_spans_follow_the_method_and_evaluation() -> None:
    maec = plan_job(parse_recipe(_maec())).spans
    linear = plan_job(parse_recipe({"merge_method": "linear", "models": [
        {"model": "s3://m/a"}, {"model": "s3://m/b"}], "evaluate": SETS})).spans
    assert maec == job_spans(extracts=True, evaluates=False)
    assert linear == job_spans(extracts=False, evaluates=True)
    assert maec.at("fetch", 1, 2) == ("fetch", 0.025)
    assert maec.at("extract", 0, 4) == ("extract", 0.05)
    # Engine stage names are the contract's.
    assert maec.at("merge", 1, 1) == ("combine", 0.95)
    assert linear.at("select", 0, 1) == ("combine", 0.05)
    assert linear.at("evaluate", 3, 3) == ("evaluate", 0.95)
    assert maec.at("publish", 0, 0) == ("publish", 1.0)
    # A sweep's evaluation is its candidates': the job's own spans are a merge's.
    swept = plan_job(parse_recipe(_maec(evaluate=SETS, sweep={
        "grid": {"mu": [0.5, 1.0]}, "objective": OBJECTIVE})))
    assert swept.spans == maec


def test_a_sweep_spreads_its_candidates_over_its_span() -> None:
    assert candidate_at("extract", 0, 1, 0, 3) == ("extract", 0.05)
    stage, frac = candidate_at("merge", 1, 2, 1, 3)
    assert stage == "combine" and frac == pytest.approx(0.05 + 0.9 * (1 + 0.55) / 3)
    assert candidate_at("evaluate", 1, 1, 3, 3)[1] == pytest.approx(0.95)


def test_the_adapter_check_looks_at_the_fetched_folders(tmp_path: Path) -> None:
    adapter, full = tmp_path / "adapter", tmp_path / "full"
    adapter.mkdir()
    full.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (full / "model.safetensors").write_bytes(b"")
    plan = plan_job(parse_recipe({"merge_method": "task_arithmetic",
                                  "base_model": "s3://m/base",
                                  "models": [{"model": "s3://m/lora"}]}))
    plan.adapters.check({"s3://m/base": str(full), "s3://m/lora": str(adapter)})
    with pytest.raises(CheckpointError, match="name its base"):
        plan.adapters.check({"s3://m/base": str(adapter), "s3://m/lora": str(adapter)})


def test_the_published_manifest_names_inputs_by_reference(tmp_path: Path) -> None:
    plan = plan_job(parse_recipe(_maec(evaluate=SETS)))
    local: dict[str, str] = {}
    for i, ref in enumerate(plan.inputs):
        where = tmp_path / "inputs" / str(i)
        where.mkdir(parents=True)
        if plan.one_file(ref):
            (where / "set.txt").write_text(ref)
            local[ref] = str(where / "set.txt")
        else:
            (where / "sub").mkdir()
            (where / "config.json").write_text(ref)
            (where / "sub" / "w.safetensors").write_bytes(ref.encode())
            local[ref] = str(where)
    # The run records each local copy by the reference the plan names it by.
    names = plan.names(local)
    localised = plan.localised(local).merge_only().model_dump(mode="json", exclude_none=True)
    written = build_manifest([], inputs={"x": {"path": local["s3://m/base"]}},
                             recipe=localised, names=names)
    doc = published_manifest(written, plan.inputs, local)
    assert str(tmp_path) not in json.dumps(doc)
    assert doc["recipe"]["base_model"] == "s3://m/base"
    assert doc["recipe"]["abilities"][0]["model"] == "local://donor"

    def sha(text: str) -> str:
        return hashlib.sha256(text.encode()).hexdigest()

    assert doc["inputs"]["s3://m/base"] == {"files": {"config.json": sha("s3://m/base"),
                                                      "sub/w.safetensors": sha("s3://m/base")}}
    assert doc["inputs"]["s3://e/qa.jsonl"] == {"files": {"set.txt": sha("s3://e/qa.jsonl")}}
    assert list(doc["inputs"]) == list(plan.inputs)
