"""lm-evaluation-harness tasks as eval sets: `maec eval` runs the offline fixture tasks
(tests/lm_eval_tasks: an MGSM-style generation task in two languages, an ARC-style
multiple-choice task) and reports lm-eval's own metric names; names are checked from the
YAML files alone; an unknown task fails with its code."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from maec_core.errors import EvalSetError, LmEvalTaskUnknown
from maec_core.eval.lm_eval_tasks import LmEvalConfig, find_task, task_names_in
from maec_core.eval.sets import EvalSetSpec, parse_spec
from maec_core.parsing import parse_recipe
from tests.conftest import TinyModels

TASKS = Path(__file__).resolve().parents[1] / "lm_eval_tasks"
FIXTURE_TASKS = {"tiny_mgsm_direct_en", "tiny_mgsm_direct_bn", "tiny_arc_easy"}


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # datasets caches what it reads (Arrow files): here, not in the home folder.
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")


def test_fixture_task_names_are_read_from_the_yaml_alone() -> None:
    assert task_names_in([TASKS]) == FIXTURE_TASKS
    assert task_names_in([TASKS / "missing"]) == set()


def test_lm_eval_sets_parse_with_their_own_fields() -> None:
    spec = parse_spec(f"""
- {{name: tiny_mgsm_direct_bn, kind: lm_eval, path: {TASKS}, limit: 2, num_fewshot: 0}}
- {{name: arc, task: tiny_arc_easy, kind: lm_eval, metric: acc_norm, batch_size: 4}}
""")
    bn, arc = spec.sets
    assert (bn.language, bn.lm_eval_task, bn.limit, bn.path) == ("bn", "tiny_mgsm_direct_bn",
                                                                   2, str(TASKS))
    assert (arc.language, arc.lm_eval_task, arc.metric) == ("und", "tiny_arc_easy", "acc_norm")
    for bad, why in ((["- {name: t, kind: lm_eval, context: 8}"], "only for kind perplexity"),
                     (["- {name: t, kind: lm_eval, max_items: 8}"], "takes limit"),
                     (["- {name: t, language: sw, kind: accuracy, path: q.jsonl, limit: 2}"],
                      "only for kind lm_eval"),
                     (["- {name: t, language: sw, kind: perplexity}"], "needs path")):
        with pytest.raises(EvalSetError, match=why):
            parse_spec("\n".join(bad))


def test_a_sweep_names_the_lm_eval_metric_its_set_gives(tiny_models: TinyModels) -> None:
    m = tiny_models
    base = {"merge_method": "linear", "models": [{"model": str(m.base)}, {"model": str(m.donor)}],
            "parameters": {"weight": 1.0},
            "evaluate": [{"name": "arc", "task": "tiny_arc_easy", "kind": "lm_eval",
                          "metric": "acc_norm"}]}
    ok = parse_recipe({**base, "sweep": {"grid": {"weight": [0.5, 1.0]},
                                         "objective": {"set": "arc", "metric": "acc_norm"}}})
    assert ok.sweep is not None and ok.sweep.objective.direction == "max"
    with pytest.raises(Exception, match="measures acc_norm, not acc"):
        parse_recipe({**base, "sweep": {"grid": {"weight": [0.5, 1.0]},
                                        "objective": {"set": "arc", "metric": "acc"}}})


def test_maec_eval_runs_lm_eval_tasks_beside_our_own_sets(tiny_models: TinyModels,
                                                        tmp_path: Path) -> None:
    from maec_core.cli import main

    (tmp_path / "wiki.txt").write_text("w1 w7 w3 w9 w4 w12\n\nw20 w3 w17 w25 w2\n")
    spec = tmp_path / "eval.yaml"
    spec.write_text(f"""sets:
  - {{name: wiki, language: sw, kind: perplexity, path: wiki.txt}}
  - {{name: tiny_mgsm_direct_en, kind: lm_eval, path: {TASKS}, limit: 3, num_fewshot: 0,
     batch_size: 2}}
  - {{name: tiny_mgsm_direct_bn, kind: lm_eval, path: {TASKS}, limit: 2,
     metric: "exact_match,flexible-extract"}}
  - {{name: tiny_arc_easy, kind: lm_eval, path: {TASKS}, metric: acc_norm}}
""")
    out = tmp_path / "report.json"
    res = CliRunner().invoke(main, ["eval", str(tiny_models.base), str(spec), "--out", str(out),
                                    "--no-progress", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    sets = {s["name"]: s for s in report["models"][0]["sets"]}
    en, bn, arc = sets["tiny_mgsm_direct_en"], sets["tiny_mgsm_direct_bn"], sets["tiny_arc_easy"]
    assert set(en["metrics"]) == {"exact_match,strict-match", "exact_match,flexible-extract"}
    assert en["metric"] == "exact_match,strict-match" and en["count"] == 3
    assert (bn["language"], bn["count"], bn["metric"]) == ("bn", 2,
                                                           "exact_match,flexible-extract")
    assert set(arc["metrics"]) == {"acc", "acc_norm"} and arc["count"] == 4
    assert arc["value"] == arc["metrics"]["acc_norm"] and 0.0 <= arc["value"] <= 1.0
    assert set(arc["stderr"]) == {"acc", "acc_norm"}
    assert arc["settings"]["higher_is_better"] == {"acc": True, "acc_norm": True}
    assert sets["wiki"]["kind"] == "perplexity"
    row = report["table"]["rows"][0]
    assert row["lm_eval"]["tiny_arc_easy"] == arc["metrics"]
    columns = {c["name"]: c["metric"] for c in report["table"]["columns"]}
    assert columns == {"wiki": "perplexity", "tiny_mgsm_direct_en": "exact_match,strict-match",
                       "tiny_mgsm_direct_bn": "exact_match,flexible-extract",
                       "tiny_arc_easy": "acc_norm"}
    assert "acc_norm" in res.output


def test_an_unknown_task_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from maec_core.eval import lm_eval_tasks

    # lm-eval's own index (thousands of YAML files, seconds to read) stands out here: the
    # fixture folder alone decides, as lm-eval's own tasks do not hold the names used.
    local = lm_eval_tasks._manager.__wrapped__
    monkeypatch.setattr(lm_eval_tasks, "_manager", lambda dirs, _defaults: local(dirs, False))
    dirs = (str(TASKS),)
    assert "tiny_arc_easy" in find_task("tiny_arc_easy", dirs).all_tasks
    with pytest.raises(LmEvalTaskUnknown) as info:
        find_task("no_such_task_xyz", dirs)
    assert info.value.code == "unknown_lm_eval_task"


def test_config_reads_the_worker_settings() -> None:
    cfg = LmEvalConfig.from_env({"MAEC_LM_EVAL_TASK_DIRS": f"{TASKS}:/x",
                                 "MAEC_LM_EVAL_DATA_DIR": "/data", "MAEC_LM_EVAL_HUB": "true"})
    assert cfg == LmEvalConfig(task_dirs=(TASKS, Path("/x")), data_dir=Path("/data"), hub=True)
    assert LmEvalConfig.from_env({}) == LmEvalConfig()
    assert EvalSetSpec(name="arc_sw", kind="lm_eval").language == "sw"


def test_the_hub_is_off_only_while_lm_eval_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    from maec_core.eval import lm_eval_tasks

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with lm_eval_tasks._offline(hub=False):
        assert huggingface_hub.constants.HF_HUB_OFFLINE is True
        assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert huggingface_hub.constants.HF_HUB_OFFLINE is False
    assert "HF_HUB_OFFLINE" not in os.environ
    with lm_eval_tasks._offline(hub=True):
        assert huggingface_hub.constants.HF_HUB_OFFLINE is False


def test_names_are_read_as_lm_eval_indexes_them(tmp_path: Path) -> None:
    (tmp_path / "common_yaml").write_text("tag:\n  - shared_tag\noutput_type: generate_until\n")
    (tmp_path / "a.yaml").write_text('include: common_yaml\n"task": "quoted_task"\n')
    (tmp_path / "b.yaml").write_text("group: my_group\ntag: [t_one, 't_two']\ntask:\n"
                                     "  - quoted_task\n")
    (tmp_path / "notes.txt").write_text("task: not_a_task\n")
    assert task_names_in([tmp_path]) == {"quoted_task", "shared_tag", "my_group", "t_one",
                                         "t_two"}


def test_lm_eval_own_names_are_known_without_importing_it() -> None:
    from maec_core.eval.lm_eval_tasks import builtin_task_names, check_lm_eval_sets

    known = builtin_task_names()
    assert known is not None
    assert {"mgsm_direct_bn", "mgsm_native_cot_sw", "arc_easy", "global_mmlu_sw",
            "afrimgsm_amh_prompt_1"} <= known
    check_lm_eval_sets([EvalSetSpec(name="mgsm_direct_sw", kind="lm_eval")], LmEvalConfig())
    with pytest.raises(LmEvalTaskUnknown, match="mgsm_direct_swx"):
        check_lm_eval_sets([EvalSetSpec(name="mgsm_direct_swx", kind="lm_eval")],
                           LmEvalConfig())
