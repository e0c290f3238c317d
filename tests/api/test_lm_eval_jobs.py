"""lm-evaluation-harness tasks in jobs (run in-process): an evaluated job and a sweep run
the offline fixture tasks (tests/lm_eval_tasks, the operator's task folder here) and
report lm-eval's metric names; an unknown task or a task folder of the job's own is
refused before queueing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.queue import QUEUE
from maec_contract import JobResult
from tests.api.conftest import Api

TASKS = Path(__file__).resolve().parents[1] / "lm_eval_tasks"
SETS: list[dict[str, Any]] = [
    {"name": "tiny_mgsm_direct_en", "kind": "lm_eval", "limit": 2, "num_fewshot": 0,
     "metric": "exact_match,flexible-extract"},
    {"name": "tiny_mgsm_direct_bn", "kind": "lm_eval", "limit": 2},
    {"name": "arc", "task": "tiny_arc_easy", "kind": "lm_eval", "metric": "acc_norm",
     "batch_size": 4},
]


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # datasets caches what it reads (Arrow files): here, not in the home folder.
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")


@pytest.fixture
def lm_api(api_factory: Any, monkeypatch: pytest.MonkeyPatch) -> Api:
    # The API checks names with its settings; the worker reads the same variable.
    monkeypatch.setenv("MAEC_LM_EVAL_TASK_DIRS", str(TASKS))
    return api_factory(lm_eval_task_dirs=str(TASKS))  # type: ignore[no-any-return]


def test_evaluated_job_reports_lm_eval_metric_names(lm_api: Api) -> None:
    job = lm_api.submit(lm_api.named("linear", evaluate=SETS, parameters={"weight": 1.0}))
    urls, _manifest = lm_api.run_published(str(job["id"]))
    done = lm_api.client.get(f"/v1/jobs/{job['id']}", headers=lm_api.auth()).json()
    evaluation = JobResult.model_validate(done["result"]).evaluation
    assert evaluation is not None
    columns = {c["name"]: (c["kind"], c["metric"]) for c in evaluation.table.columns}
    assert columns == {"tiny_mgsm_direct_en": ("lm_eval", "exact_match,flexible-extract"),
                       "tiny_mgsm_direct_bn": ("lm_eval", "exact_match,strict-match"),
                       "arc": ("lm_eval", "acc_norm")}
    row = evaluation.table.rows[0]
    assert row["model"] == "merged"
    assert set(row["lm_eval"]["arc"]) == {"acc", "acc_norm"}
    assert set(row["lm_eval"]["tiny_mgsm_direct_bn"]) == {"exact_match,strict-match",
                                                          "exact_match,flexible-extract"}
    assert row["cells"]["arc"] == row["lm_eval"]["arc"]["acc_norm"]
    report = lm_api.client.get(urls["eval_report.json"], headers=lm_api.auth()).json()
    sets = {s["name"]: s for s in report["models"][0]["sets"]}
    assert (sets["tiny_mgsm_direct_bn"]["language"], sets["tiny_mgsm_direct_bn"]["count"]) \
        == ("bn", 2)
    assert sets["arc"]["count"] == 4 and sets["arc"]["settings"]["task"] == "tiny_arc_easy"


def test_sweep_optimises_an_lm_eval_metric_under_a_constraint(lm_api: Api) -> None:
    sweep = {"grid": {"weight": [0.0, 1.0]},
             "objective": {"set": "arc", "metric": "acc_norm"},
             "constraint": {"set": "tiny_mgsm_direct_en",
                            "metric": "exact_match,flexible-extract", "min": 0.0}}
    job = lm_api.submit(lm_api.named("task_arithmetic", evaluate=[SETS[0], SETS[2]],
                                     sweep=sweep))
    lm_api.run_published(str(job["id"]))
    done = lm_api.client.get(f"/v1/jobs/{job['id']}", headers=lm_api.auth()).json()
    board = JobResult.model_validate(done["result"]).sweep
    assert board is not None and board.winner in ("c00", "c01")
    assert [r.id for r in board.rows] == ["c00", "c01"]
    for r in board.rows:
        assert set(r.scores) == {"arc", "tiny_mgsm_direct_en"} and r.feasible
        assert r.objective == r.scores["arc"]
    best = max(board.rows, key=lambda r: r.scores["arc"])
    assert board.rows[[r.id for r in board.rows].index(board.winner)].objective \
        == best.scores["arc"]


def _refused(api: Api, body: dict[str, object], code: str) -> str:
    r = api.client.post("/v1/jobs", json=body, headers=api.auth())
    assert r.status_code == 422, r.text
    assert r.json()["code"] == code, r.json()
    assert api.r.llen(QUEUE) == 0
    return str(r.json()["message"])


def test_unknown_tasks_and_foreign_task_folders_are_refused(
        lm_api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    from maec_core.eval import lm_eval_tasks

    # lm-eval's own names (read from its thousands of YAML files) do not hold this one.
    monkeypatch.setattr(lm_eval_tasks, "builtin_task_names", lambda: frozenset({"arc_easy"}))
    body = lm_api.named("linear", parameters={"weight": 1.0},
                        evaluate=[{"name": "no_such_task_bn", "kind": "lm_eval"}])
    assert "no_such_task_bn" in _refused(lm_api, body, "unknown_lm_eval_task")
    own = lm_api.root / "extra"
    body = lm_api.named("linear", parameters={"weight": 1.0},
                        evaluate=[{"name": "tiny_arc_easy", "kind": "lm_eval",
                                   "path": str(own)}])
    assert "MAEC_LM_EVAL_TASK_DIRS" in _refused(lm_api, body, "invalid_eval_set")


def test_a_name_only_the_worker_can_check_fails_the_job_with_its_code(
        lm_api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    from maec_core.eval import lm_eval_tasks
    from worker.runner import JobRunner

    # An API without lm-eval installed cannot read lm-eval's own names: the worker does.
    monkeypatch.setattr(lm_eval_tasks, "builtin_task_names", lambda: None)
    local = lm_eval_tasks._manager.__wrapped__
    monkeypatch.setattr(lm_eval_tasks, "_manager", lambda dirs, _defaults: local(dirs, False))
    job = lm_api.submit(lm_api.named("linear", parameters={"weight": 1.0},
                                     evaluate=[{"name": "no_such_task_bn", "kind": "lm_eval"}]))
    runner = JobRunner(lm_api.settings, lm_api.worker_store(), lm_api.storage(), worker="test")
    assert runner.run(str(job["id"])) == "failed"
    done = lm_api.client.get(f"/v1/jobs/{job['id']}", headers=lm_api.auth()).json()
    assert done["error"]["code"] == "unknown_lm_eval_task", done["error"]
    assert "no_such_task_bn" in done["error"]["message"]
    assert "Traceback" not in str(done["error"])
