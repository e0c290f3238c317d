"""Evaluation and sweeps through the API and the worker's pipeline (run in-process):
bad eval sets and sweeps refused with their codes before queueing, evaluated jobs and
sweeps publishing their tables, reports and candidates."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from app.queue import QUEUE
from app.storage.local import LocalStorage
from maec_contract import JobResult
from tests.api.conftest import Api
from worker.runner import JobRunner

TEXT = "w1 w7 w3 w9 w4 w12 w30 w2 w8 w11 w5 w19\n\nw20 w3 w17 w25 w2 w33 w9 w1\n"


def _sets(api: Api, *, qa: bool = False) -> list[dict[str, Any]]:
    extra = api.root / "extra"
    (extra / "wiki.txt").write_text(TEXT)
    sets: list[dict[str, Any]] = [{"name": "wiki-sw", "language": "sw",
                                   "kind": "perplexity", "path": str(extra / "wiki.txt")}]
    if qa:
        (extra / "qa.jsonl").write_text(
            json.dumps({"question": "w1 w2", "answer": "3"}) + "\n")
        sets.append({"name": "qa-sw", "language": "sw", "kind": "accuracy",
                     "path": str(extra / "qa.jsonl"), "max_new_tokens": 2})
    return sets


def _refused(api: Api, body: dict[str, Any], code: str) -> dict[str, Any]:
    r = api.client.post("/v1/jobs", json=body, headers=api.auth())
    assert r.status_code == 422, r.text
    doc = dict(r.json())
    assert doc["code"] == code, doc
    assert api.r.llen(QUEUE) == 0 and not api.r.keys("maec:job:*")
    return doc


def _run(api: Api, jid: str, writes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    store = api.worker_store()
    if writes is not None:
        update = store.update

        def recording(job_id: str, attempt: int, fields: dict[str, Any]) -> int:
            if "progress" in fields:
                writes.append({"stage": fields.get("stage"), **fields["progress"]})
            return update(job_id, attempt, fields)

        store.update = recording  # type: ignore[method-assign]
    runner = JobRunner(api.settings, store, LocalStorage(api.settings.storage_dir),
                       worker="test")
    runner.run(jid)
    return dict(api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json())


def test_malformed_line_is_refused_with_its_number(api: Api) -> None:
    bad = api.root / "extra" / "bad.jsonl"
    bad.write_text('{"text": "w1 w2"}\n{"text": "w3"}\n{"text": 5}\n')
    sets = [{"name": "bad", "language": "sw", "kind": "perplexity", "path": str(bad)}]
    doc = _refused(api, api.named(evaluate=sets), "invalid_eval_set")
    assert doc["details"]["line"] == 3 and "line 3" in doc["message"]


@pytest.mark.parametrize(("entry", "code"), [
    ({"path": "/nope/missing.txt"}, "invalid_source"),  # outside the allowed roots
    ({"path": "MISSING"}, "eval_set_unreadable"),
    ({"kind": "bogus"}, "invalid_eval_set"),
    ({"kind": "accuracy"}, "invalid_eval_set"),  # a .txt file cannot be a QA set
    ({"max_items": 0}, "invalid_eval_set"),
])
def test_bad_eval_sets_are_refused(api: Api, entry: dict[str, Any], code: str) -> None:
    base = _sets(api)[0]
    if entry.get("path") == "MISSING":
        entry = {"path": str(api.root / "extra" / "missing.txt")}
    _refused(api, api.named(evaluate=[{**base, **entry}]), code)


def test_unreadable_eval_set_bytes(api: Api) -> None:
    bad = api.root / "extra" / "latin1.txt"
    bad.write_bytes(b"w1 w2\n\xff\xfe w3\n")
    sets = [{"name": "l1", "language": "sw", "kind": "perplexity", "path": str(bad)}]
    doc = _refused(api, api.named(evaluate=sets), "eval_set_unreadable")
    assert doc["details"]["line"] == 2


@pytest.mark.parametrize(("sweep", "code"), [
    ({"grid": {"gamma": [0.5]}, "objective": {"set": "wiki-sw", "metric": "perplexity"}},
     "invalid_sweep"),  # task_arithmetic has no gamma
    ({"grid": {"weight": [0.5]}, "objective": {"set": "nope", "metric": "perplexity"}},
     "invalid_sweep"),
    ({"grid": {"weight": ["x"]}, "objective": {"set": "wiki-sw", "metric": "perplexity"}},
     "invalid_sweep"),
])
def test_bad_sweeps_are_refused(api: Api, sweep: dict[str, Any], code: str) -> None:
    _refused(api, api.named(evaluate=_sets(api), sweep=sweep), code)


def test_evaluate_given_twice_is_refused(api: Api) -> None:
    m = api.models
    recipe = {"merge_method": "linear", "models": [{"model": str(m.donor)},
                                                   {"model": str(m.lang)}],
              "evaluate": _sets(api)}
    _refused(api, {"recipe": recipe, "evaluate": _sets(api)}, "invalid_recipe")


def test_evaluated_job_publishes_table_and_report(api: Api) -> None:
    job = api.submit(api.named("linear", evaluate=_sets(api, qa=True), evaluate_inputs=True,
                               parameters={"weight": 1.0}))
    writes: list[dict[str, Any]] = []
    done = _run(api, str(job["id"]), writes)
    stages = [w["stage"] for w in writes]
    assert stages.index("evaluate") > stages.index("combine")
    assert stages.index("publish") > max(i for i, s in enumerate(stages) if s == "evaluate")
    fractions = [w["fraction"] for w in writes]
    assert fractions == sorted(fractions)
    assert [w["fraction"] for w in writes if w["stage"] == "evaluate"][-1] == 0.95
    assert done["status"] == "succeeded", done["error"]
    result = JobResult.model_validate(done["result"])
    evaluation = result.evaluation
    assert evaluation is not None and evaluation.label == "merged"
    rows = [r["model"] for r in evaluation.table.rows]
    assert rows == ["merged", "language_base", "donor"]
    assert [c["name"] for c in evaluation.table.columns] == ["wiki-sw", "qa-sw"]
    files = {f.path for f in result.files}
    assert {"eval_report.json", "README.md", "manifest.json"} <= files
    report = api.client.get(f"/v1/jobs/{job['id']}/files/eval_report.json",
                            headers=api.auth()).json()
    assert report["models"][0]["sets"][1]["items"][0]["question"] == "w1 w2"
    card = api.client.get(f"/v1/jobs/{job['id']}/files/README.md", headers=api.auth()).text
    assert "## Evaluation" in card and "wiki-sw [sw]" in card


def test_sweep_job_publishes_winner_and_every_candidate(api: Api) -> None:
    sweep = {"grid": {"weight": [0.0, 1.0]},
             "objective": {"set": "wiki-sw", "metric": "perplexity"}, "publish": "all"}
    job = api.submit(api.named("task_arithmetic", evaluate=_sets(api), sweep=sweep))
    writes: list[dict[str, Any]] = []
    done = _run(api, str(job["id"]), writes)
    swept = [w for w in writes if "candidate" in w]
    assert {w["candidate"] for w in swept} == {1, 2}
    assert {w["candidates"] for w in swept} == {2}
    assert {"combine", "evaluate"} <= {w["stage"] for w in swept}
    fractions = [w["fraction"] for w in writes]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert done["status"] == "succeeded", done["error"]
    result = JobResult.model_validate(done["result"])
    board = result.sweep
    assert board is not None and board.winner in ("c00", "c01")
    assert [r.id for r in board.rows] == ["c00", "c01"]
    assert board.candidates == {"c00": "candidates/c00/", "c01": "candidates/c01/"}
    files = {f.path: f for f in result.files}
    for name in ("leaderboard.json", "sweep.png", "eval_report.json", "manifest.json",
                 "candidates/c00/manifest.json", "candidates/c01/model.safetensors"):
        assert name in files, name
        r = api.client.get(files[name].url, headers=api.auth())
        assert r.status_code == 200, name
    for name, f in files.items():
        data = api.client.get(f.url, headers=api.auth()).content
        assert hashlib.sha256(data).hexdigest() == f.sha256, name
    served = api.client.get(files["leaderboard.json"].url, headers=api.auth()).json()
    assert served["winner"] == board.winner
    m = api.models
    refs = {str(m.base), str(m.donor), str(m.lang), _sets(api)[0]["path"]}
    for name in ("manifest.json", "candidates/c00/manifest.json",
                 "candidates/c01/manifest.json"):
        api.assert_named_by_reference(
            api.client.get(files[name].url, headers=api.auth()).json(), refs)
    # Nothing of the sweep is left in the worker's folders.
    assert not list((api.settings.work_dir / "jobs").rglob("*.safetensors"))
