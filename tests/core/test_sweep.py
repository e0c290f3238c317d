"""Sweeps on tiny models whose best setting is known by construction.

The donor is the base with its transformer-block weights trained to memorise the eval
texts; the language base is the base plus a little noise. Adding the donor's whole task
vector (MAEC key_ratio 1, mu 1; task arithmetic weight 1) gives back the memoriser, so
that candidate has the lowest perplexity on the memorised texts, and mu 0 the highest.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner

from maec_core.artifact_store import LocalArtifactStore
from maec_core.context import RunContext
from maec_core.errors import Cancelled, CheckpointError, NoFeasibleCandidate, SweepError
from maec_core.eval.report import ModelResult, read_report
from maec_core.parsing import parse_recipe
from maec_core.runtime import torch_threads
from maec_core.sweep.board import read_leaderboard
from maec_core.sweep.grid import candidates
from maec_core.sweep.runner import SweepOptions, evaluate_folder, run_sweep
from tests.factories import make_llama, tiny_tokenizer

TEXTS = [
    "w1 w7 w3 w9 w4 w12 w30 w2 w8 w11 w5 w19 w22 w6 w13 w27 w10 w31 w0 w14",
    "w20 w3 w17 w25 w2 w33 w9 w1 w16 w28 w4 w35 w12 w7 w38 w21 w5 w26 w11 w36",
]


def _memorise(base: Path, path: Path) -> Path:
    """``base`` with only its block weights trained on TEXTS (embeddings, norms and
    lm_head untouched, so the whole difference is what MAEC extracts by default)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    tok = tiny_tokenizer()
    ids = torch.tensor([tok(t)["input_ids"] for t in TEXTS])
    params = [p for n, p in model.named_parameters() if ".layers." in n and p.ndim == 2]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=1e-2)
    torch.manual_seed(0)
    for _ in range(150):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sweep")
    with torch_threads(1):
        base = make_llama(root / "base", 0)
        donor = _memorise(base, root / "donor")
        lang = make_llama(root / "lang", 1, like=base, noise=0.001)
    (root / "texts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (root / "other.txt").write_text("w40 w41 w42 w43 w44 w45 w46 w47\n\nw50 w51 w52 w53\n")
    return {"root": root, "base": base, "donor": donor, "lang": lang}


def _sets(world: dict[str, Path]) -> list[dict[str, Any]]:
    return [{"name": "memorised", "language": "en", "kind": "perplexity",
             "path": str(world["root"] / "texts.jsonl")},
            {"name": "other", "language": "sw", "kind": "perplexity",
             "path": str(world["root"] / "other.txt")}]


def _maec(world: dict[str, Path], sweep: dict[str, Any], **extra: Any) -> Any:
    return parse_recipe({
        "merge_method": "maec", "base_model": str(world["base"]),
        "language_base": str(world["lang"]), "abilities": [{"model": str(world["donor"])}],
        "parameters": {"selection_ratio": 1.0}, "evaluate": _sets(world), "sweep": sweep,
        "name": "swept", **extra})


GRID = {"key_ratio": [0.25, 1.0], "mu": [0.0, 1.0]}
OBJ = {"set": "memorised", "metric": "perplexity"}


def test_maec_sweep_finds_the_constructed_best(world: dict[str, Path], tmp_path: Path
                                               ) -> None:
    recipe = _maec(world, {"grid": GRID, "objective": OBJ})
    store = LocalArtifactStore(tmp_path / "store")
    seen: list[tuple[int, int]] = []
    with torch_threads(1):
        result = run_sweep(
            recipe,
            tmp_path / "out",
            RunContext(artifact_store=store, device="cpu"),
            SweepOptions(announce=lambda i, n: seen.append((i, n))),
        )
    board = result.board
    assert [r.id for r in board.rows] == ["c00", "c01", "c02", "c03"]
    assert board.winner == "c03" and board.row("c03").values == {"key_ratio": 1.0,
                                                                   "mu": 1.0}
    assert board.row("c03").rank == 1
    # mu 0 adds nothing: both such candidates are the language base, the worst.
    worst = {r.id for r in board.rows if r.rank in (3, 4)}
    assert worst == {"c00", "c02"}
    assert "lowest perplexity on memorised" in board.why
    # One extraction per key_ratio; the mu-only candidates reused it.
    assert result.extractions == 2
    assert [r.extracted for r in board.rows] == [True, False, True, False]
    assert seen == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]
    out = tmp_path / "out"
    names = {p.name for p in out.iterdir()}
    assert {"eval_report.json", "leaderboard.json", "sweep.png", "README.md",
            "manifest.json", "recipe.yaml"} <= names
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    manifest = json.loads((out / "manifest.json").read_text())
    listed = {f["path"] for f in manifest["files"]}
    assert {"eval_report.json", "leaderboard.json", "sweep.png"} <= listed
    import hashlib
    for f in manifest["files"]:
        assert hashlib.sha256((out / f["path"]).read_bytes()).hexdigest() == f["sha256"]
    report = read_report(out / "eval_report.json")
    assert [m.label for m in report.models] == ["c00", "c01", "c02", "c03"]
    assert read_leaderboard(out / "leaderboard.json").winner == "c03"
    card = (out / "README.md").read_text()
    assert "## Evaluation" in card and "**c03**" in card and card.index(
        "## Evaluation") < card.index("## Recipe")
    # The published recipe is the winner's, concrete: no sweep, its parameters set.
    published = yaml.safe_load((out / "recipe.yaml").read_text())
    assert "sweep" not in published and published["parameters"]["key_ratio"] == 1.0
    assert published["abilities"][0]["mu"] == 1.0
    # Nothing else is left beside the output.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "store"]


def test_constraint_against_language_base(world: dict[str, Path], tmp_path: Path) -> None:
    # The memoriser forgets nothing about "other" it never knew... so bound "other"
    # tightly: only candidates within 0.1% of the language base there may win.
    sweep = {"grid": {"mu": [0.0, 1.0]}, "objective": OBJ,
             "constraint": {"set": "other", "metric": "perplexity",
                            "max_ratio_to": "language_base", "value": 1.001}}
    recipe = _maec(world, sweep, parameters={"key_ratio": 1.0, "selection_ratio": 1.0})
    with torch_threads(1):
        result = run_sweep(recipe, tmp_path / "out", RunContext(device="cpu"))
    board = result.board
    ref = board.reference["other"]
    for r in board.rows:
        assert r.feasible == (r.scores["other"] <= 1.001 * ref)
    assert board.row("c00").feasible  # mu 0 is the language base itself
    if board.row("c01").feasible:
        assert board.winner == "c01"
    else:
        assert board.winner == "c00" and "1 excluded by the constraint" in board.why
    report = read_report(tmp_path / "out" / "eval_report.json")
    assert report.models[0].label == "language_base"


def test_no_feasible_candidate_leaves_nothing(world: dict[str, Path], tmp_path: Path
                                              ) -> None:
    sweep = {"grid": {"mu": [0.0, 1.0]}, "objective": OBJ,
             "constraint": {"set": "other", "metric": "perplexity", "max": 1.0}}
    with torch_threads(1), pytest.raises(NoFeasibleCandidate) as err:
        run_sweep(_maec(world, sweep), tmp_path / "out", RunContext(device="cpu"))
    assert err.value.code == "no_feasible_candidate"
    assert list(tmp_path.iterdir()) == []


def test_cancelled_sweep_leaves_nothing(world: dict[str, Path], tmp_path: Path) -> None:
    started: list[int] = []
    with torch_threads(1), pytest.raises(Cancelled):
        run_sweep(
            _maec(world, {"grid": GRID, "objective": OBJ}),
            tmp_path / "out",
            RunContext(device="cpu", cancel=lambda: len(started) >= 2),
            SweepOptions(work_dir=tmp_path / "work", announce=lambda i, n: started.append(i)),
        )
    assert started == [0, 1]
    assert list((tmp_path / "work").iterdir()) == []
    assert not (tmp_path / "out").exists()


def test_task_arithmetic_sweep_and_publish_all(world: dict[str, Path], tmp_path: Path
                                               ) -> None:
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump({
        "merge_method": "task_arithmetic", "base_model": str(world["base"]),
        "models": [{"model": str(world["donor"]), "parameters": {"weight": 1.0}},
                   {"model": str(world["lang"]), "parameters": {"weight": 0.0}}]}))
    sweep_file = tmp_path / "sweep.yaml"
    (tmp_path / "sets").mkdir()
    (tmp_path / "sets" / "t.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    sweep_file.write_text(yaml.safe_dump({
        "evaluate": [{"name": "memorised", "language": "en", "kind": "perplexity",
                      "path": "sets/t.jsonl"}],
        "evaluate_inputs": True,
        "grid": {"models[0].weight": [0.0, 0.5, 1.0]}, "objective": OBJ,
        "publish": "all"}))
    from maec_core.sweep.cli import sweep_command

    with torch_threads(1):
        res = CliRunner().invoke(sweep_command, [str(recipe_file), str(sweep_file),
                                                 str(tmp_path / "out"), "--device", "cpu",
                                                 "--cache-dir", str(tmp_path / "cache"),
                                                 "--resident-mb", "0"])
    assert res.exit_code == 0, res.output
    out = tmp_path / "out"
    board = read_leaderboard(out / "leaderboard.json")
    assert board.winner == "c02" and board.extractions == 0
    assert board.resident is None  # no language base to hold
    assert sorted(p.name for p in (out / "candidates").iterdir()) == ["c00", "c01", "c02"]
    c01 = json.loads((out / "candidates" / "c01" / "manifest.json").read_text())
    assert c01["evaluation"]["label"] == "c01"
    labels = [m.label for m in read_report(out / "eval_report.json").models]
    assert labels == ["language_base", "donor", "c00", "c01", "c02"]
    # Weight 1 on the donor is the donor: the same perplexity.
    rows = read_report(out / "eval_report.json").models
    assert rows[-1].sets[0].value == pytest.approx(rows[1].sets[0].value, rel=1e-4)
    # Candidates are scored with one model whose weights are swapped: the same scores
    # as a fresh load of each candidate's folder.
    from maec_core.eval.runner import evaluate
    from maec_core.eval.sets import load_spec

    spec_file = tmp_path / "sets" / "spec.yaml"
    spec_file.write_text(yaml.safe_dump([{"name": "memorised", "language": "en",
                                          "kind": "perplexity", "path": "t.jsonl"}]))
    for cid in ("c00", "c01"):
        with torch_threads(1):
            fresh = evaluate(
                out / "candidates" / cid, load_spec(spec_file), RunContext(device="cpu")
            )
        assert fresh.models[0].sets[0].value == board.row(cid).scores["memorised"]


def test_evaluate_folder_attaches_report(world: dict[str, Path], tmp_path: Path) -> None:
    from maec_core.run import run

    recipe = parse_recipe({
        "merge_method": "linear",
        "models": [{"model": str(world["donor"]), "parameters": {"weight": 1.0}},
                   {"model": str(world["lang"]), "parameters": {"weight": 1.0}}],
        "evaluate": _sets(world), "evaluate_inputs": True})
    with torch_threads(1):
        run(recipe.merge_only(), tmp_path / "m", RunContext(device="cpu"))
        evaluated = evaluate_folder(recipe, tmp_path / "m", RunContext(device="cpu"))
    assert [m.label for m in evaluated.report.models] == ["merged", "language_base", "donor"]
    card = (tmp_path / "m" / "README.md").read_text()
    assert "| merged |" in card and "memorised [en]" in card
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert "eval_report.json" in {f["path"] for f in manifest["files"]}
    assert evaluated.manifest == manifest


@pytest.mark.parametrize(("sweep", "code", "words"), [
    ({"grid": {"nope": [1]}, "objective": OBJ}, "invalid_sweep", "not a parameter"),
    ({"grid": {"selection": [1]}, "objective": OBJ}, "invalid_sweep", "not a numeric"),
    ({"grid": {"key_ratio": [2.0]}, "objective": OBJ}, "invalid_sweep", "candidate c00"),
    ({"grid": {"key_ratio": [True]}, "objective": OBJ}, "invalid_sweep", "not a number"),
    ({"grid": {"a": list(range(9)), "mu": list(range(8))}, "objective": OBJ},
     "invalid_sweep", "at most 64"),
    ({"grid": {"mu": [1]}, "objective": {"set": "nope", "metric": "perplexity"}},
     "invalid_sweep", "not one of the eval sets"),
    ({"grid": {"mu": [1]}, "objective": {"set": "memorised", "metric": "accuracy"}},
     "invalid_sweep", "measures perplexity"),
    ({"grid": {"models[0].weight": [1]}, "objective": OBJ}, "invalid_sweep",
     "0 entries"),
    ({"grid": {"mu": [1]}, "objective": OBJ,
      "tie_break": {"set": "nope", "metric": "perplexity"}},
     "invalid_sweep", "sweep.tie_break.set 'nope' is not one of the eval sets"),
])
def test_bad_sweeps_are_refused(world: dict[str, Path], sweep: dict[str, Any], code: str,
                                words: str) -> None:
    with pytest.raises(SweepError) as err:
        candidates(_maec(world, sweep))
    assert err.value.code == code and words in err.value.message, err.value.message


@pytest.mark.parametrize(("method", "grid", "where"), [
    ("ties", {"density": [0.3, 0.7]}, lambda r: [m.parameters["density"] for m in r.models]),
    ("task_arithmetic", {"lambda": [0.5, 2.0]}, lambda r: [r.parameters["lambda"]]),
    ("layer_swap", {"bottom_k": [0, 1], "top_k": [1]},
     lambda r: [r.parameters["bottom_k"], r.parameters["top_k"]]),
])
def test_baseline_knobs(world: dict[str, Path], method: str, grid: dict[str, list[Any]],
                        where: Any) -> None:
    models = [{"model": str(world["donor"])}, {"model": str(world["lang"])}]
    if method == "layer_swap":
        models[0]["parameters"] = {"role": "ability"}
        models[1]["parameters"] = {"role": "language"}
    recipe = parse_recipe({
        "merge_method": method, "models": models,
        **({} if method == "layer_swap" else {"base_model": str(world["base"])}),
        "evaluate": _sets(world), "sweep": {"grid": grid, "objective": OBJ}})
    cands = candidates(recipe)
    first = next(iter(grid.values()))
    assert len(cands) == len(first) and all(c.group is None for c in cands)
    for cand, value in zip(cands, first, strict=True):
        assert where(cand.recipe)[0] == value
        assert cand.recipe.sweep is None and cand.recipe.evaluate is None
    if method == "layer_swap":
        # Integer knobs stay integers in the candidate recipes.
        assert isinstance(cands[1].recipe.parameters["bottom_k"], int)


@pytest.fixture
def shard_folders(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The candidates the merge engine writes checkpoint shards for, in order (read off
    the staging folders' names, ``.<candidate>.staging-...``)."""
    import maec_core.publish as publish

    seen: list[str] = []

    class Spy(publish.ShardedWriter):
        def __init__(self, folder: Path, *args: Any, **kw: Any) -> None:
            seen.append(folder.name.split(".")[1])
            super().__init__(folder, *args, **kw)

    monkeypatch.setattr(publish, "ShardedWriter", Spy)
    return seen


def _separately(recipe: Any, root: Path) -> dict[str, ModelResult]:
    """Each candidate as a separate job: merged into its own folder, then evaluated
    afresh from it; its result by candidate id."""
    from maec_core.eval.runner import evaluate
    from maec_core.run import run
    from maec_core.sweep.inputs import eval_spec

    root.mkdir()
    results = {}
    for cand in candidates(recipe):
        with torch_threads(1):
            run(cand.recipe, root / cand.id, RunContext(device="cpu"))
            report = evaluate(root / cand.id, eval_spec(recipe), RunContext(device="cpu"))
        results[cand.id] = report.models[0]
    return results


def _scores(results: dict[str, ModelResult]) -> dict[str, dict[str, float]]:
    return {cid: {s.name: s.value for s in m.sets} for cid, m in results.items()}


def _generated(result: ModelResult) -> dict[str, list[tuple[str, int]]]:
    """Every accuracy item's output and its length in tokens, by set."""
    return {s.name: [(it.output, it.output_tokens) for it in s.items or []]
            for s in result.sets if s.kind == "accuracy"}


def _verifies(folder: Path) -> None:
    """Every file of ``folder`` but the manifest is listed in it, with its sha256."""
    import hashlib

    manifest = json.loads((folder / "manifest.json").read_text())
    listed = {f["path"]: f["sha256"] for f in manifest["files"]}
    assert set(listed) == {p.name for p in folder.iterdir()} - {"manifest.json"}
    for name, digest in listed.items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name


@pytest.fixture(scope="module")
def generating(world: dict[str, Path]) -> dict[str, Any]:
    """The language base with a generation config that ends a generation at one more
    token than config.json names (a word the memoriser produces), and an accuracy set
    whose prompts start the memorised texts: what a candidate generates depends on
    its generation config being the checkpoint's."""
    from tests.factories import tiny_tokenizer

    root = world["root"] / "generating"
    lang = root / "lang"
    shutil.copytree(world["lang"], lang)
    stop = tiny_tokenizer().convert_tokens_to_ids("w12")
    gen = json.loads((lang / "generation_config.json").read_text())
    assert json.loads((lang / "config.json").read_text())["eos_token_id"] == 2
    (lang / "generation_config.json").write_text(json.dumps({**gen,
                                                             "eos_token_id": [2, stop]}))
    qa = root / "qa.jsonl"
    qa.write_text("".join(json.dumps({"question": " ".join(t.split()[:k]), "answer": "1"})
                          + "\n" for t in TEXTS for k in (2, 3)))
    return {"lang": lang, "stop": "w12", "new_tokens": 6,
            "set": {"name": "continue", "language": "en", "kind": "accuracy",
                    "path": str(qa), "template": "{question}", "max_new_tokens": 6}}


def test_candidates_scored_from_memory_equal_separate_jobs(
        world: dict[str, Path], generating: dict[str, Any], tmp_path: Path,
        shard_folders: list[str]) -> None:
    recipe = _maec(world, {"grid": GRID, "objective": OBJ},
                   language_base=str(generating["lang"]),
                   evaluate=[*_sets(world), generating["set"]])
    with torch_threads(1):
        result = run_sweep(
            recipe,
            tmp_path / "out",
            RunContext(device="cpu"),
            SweepOptions(work_dir=tmp_path / "work"),
        )
    board = result.board
    assert board.winner == "c03"
    # No candidate was written to be scored, not even the first (the model is built
    # from its merge's definition files); only the winner, merged again to be
    # published.
    assert shard_folders == ["c03"]
    separate = _separately(recipe, tmp_path / "separate")
    assert {r.id: r.scores for r in board.rows} == _scores(separate)
    # Generation as well: the same outputs, token for token. The generation config
    # decides where they end: the memoriser stops at the word only it names.
    swept = {m.label: m for m in result.report.models}
    for cid, alone in separate.items():
        assert _generated(swept[cid]) == _generated(alone), cid
    ends = [out for out, n in _generated(swept["c03"])["continue"]
            if n < generating["new_tokens"]]
    assert ends and all(out.split()[-1] == generating["stop"] for out in ends)
    out = tmp_path / "out"
    _verifies(out)
    assert {"config.json", "model.safetensors", "maec_report.json", "recipe.yaml",
            "README.md", "eval_report.json", "leaderboard.json", "sweep.png",
            "tokenizer.json", "generation_config.json"} <= {p.name for p in out.iterdir()}
    # The published winner holds the very tensors a separate merge of it gives, and the
    # same report (every c_t, reused from its group's first combination).
    for name in ("model.safetensors", "maec_report.json", "generation_config.json"):
        assert (out / name).read_bytes() == (
            tmp_path / "separate" / "c03" / name).read_bytes(), name
    assert list((tmp_path / "work").iterdir()) == []


def test_whole_tensor_method_in_memory_with_output_cast(
        world: dict[str, Path], tmp_path: Path, shard_folders: list[str]) -> None:
    # DARE-TIES takes whole tensors (the engine's other loop) and draws seeded masks;
    # a bfloat16 output reaches the float32 model as bfloat16 bytes, converted as a
    # load converts them.
    recipe = parse_recipe({
        "merge_method": "dare_ties", "base_model": str(world["base"]),
        "models": [{"model": str(world["donor"]), "parameters": {"weight": 1.0}},
                   {"model": str(world["lang"]), "parameters": {"weight": 0.5}}],
        "parameters": {"random_seed": 7}, "dtype": "bfloat16",
        "evaluate": _sets(world),
        "sweep": {"grid": {"density": [0.9, 0.5, 0.2]}, "objective": OBJ}})
    with torch_threads(1):
        result = run_sweep(recipe, tmp_path / "out", RunContext(device="cpu"))
    board = result.board
    assert board.rows[0].scores != board.rows[1].scores  # the candidates differ
    assert shard_folders == [board.winner]
    separate = _separately(recipe, tmp_path / "separate")
    assert {r.id: r.scores for r in board.rows} == _scores(separate)
    _verifies(tmp_path / "out")
    assert board.winner is not None
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (
        tmp_path / "separate" / board.winner / "model.safetensors").read_bytes()


def _cancelled_sweep(world: dict[str, Path], tmp_path: Path, progress: Any,
                     started: list[int], stages: list[str]) -> None:
    """A sweep cancelled once ``progress`` has seen the combine stage; nothing is left in
    its work folder nor at its output."""
    with torch_threads(1), pytest.raises(Cancelled):
        run_sweep(_maec(world, {"grid": GRID, "objective": OBJ}), tmp_path / "out",
                  RunContext(device="cpu", progress=progress,
                             cancel=lambda: "combine" in stages),
                  SweepOptions(work_dir=tmp_path / "work",
                               announce=lambda i, n: started.append(i)))
    assert list((tmp_path / "work").iterdir()) == []
    assert not (tmp_path / "out").exists()


def test_cancel_during_an_in_memory_merge(world: dict[str, Path], tmp_path: Path) -> None:
    started: list[int] = []
    stages: list[str] = []

    def progress(stage: str, _done: int, _total: int) -> None:
        if started and started[-1] >= 1:
            stages.append(stage)

    _cancelled_sweep(world, tmp_path, progress, started, stages)
    # Candidate c01 was being merged into the model when the cancel came.
    assert started == [0, 1] and "combine" in stages


def test_cancel_during_the_first_merge_leaves_nothing(
        world: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from maec_core.sweep.scoring import ModelSlot

    built: list[Path] = []
    real_build = ModelSlot.build

    def build(slot: ModelSlot, skeleton: Path, given: set[str]) -> Any:
        built.append(skeleton)
        assert {p.name for p in skeleton.iterdir()} >= {"config.json", "tokenizer.json"}
        assert not list(skeleton.glob("*.safetensors"))
        return real_build(slot, skeleton, given)

    monkeypatch.setattr(ModelSlot, "build", build)
    started: list[int] = []
    stages: list[str] = []

    def progress(stage: str, done: int, _total: int) -> None:
        if built and done > 0:  # the merge's own progress, once the model is built
            stages.append(stage)

    _cancelled_sweep(world, tmp_path, progress, started, stages)
    # c00's tensors were going into the model built from its definition files.
    assert started == [0] and len(built) == 1


def test_tied_embeddings_and_an_output_cast_score_as_separate_jobs(
        world: dict[str, Path], tmp_path: Path, shard_folders: list[str]) -> None:
    # The output head shares the embeddings (stored once), and the bfloat16 output is
    # scored on the CPU in float32, the first candidate too.
    root = tmp_path / "tied"
    with torch_threads(1):
        base = make_llama(root / "base", 20, tie_word_embeddings=True)
        donor = make_llama(root / "donor", 21, like=base, tie_word_embeddings=True)
        lang = make_llama(root / "lang", 22, like=base, tie_word_embeddings=True)
    recipe = parse_recipe({
        "merge_method": "task_arithmetic", "base_model": str(base),
        "models": [{"model": str(donor), "parameters": {"weight": 1.0}},
                   {"model": str(lang), "parameters": {"weight": 0.5}}],
        "dtype": "bfloat16", "evaluate": _sets(world),
        "sweep": {"grid": {"models[0].weight": [0.0, 0.5, 1.0]}, "objective": OBJ}})
    with torch_threads(1):
        result = run_sweep(recipe, tmp_path / "out", RunContext(device="cpu"))
    board = result.board
    assert len({json.dumps(r.scores, sort_keys=True) for r in board.rows}) == 3
    assert shard_folders == [board.winner]
    assert {m.label: m.dtype for m in result.report.models} == {
        "c00": "float32", "c01": "float32", "c02": "float32"}
    separate = _separately(recipe, tmp_path / "separate")
    assert {r.id: r.scores for r in board.rows} == _scores(separate)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["dtype"] == "bfloat16"
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (
        tmp_path / "separate" / str(board.winner) / "model.safetensors").read_bytes()


def test_model_sink_checks_names_and_shapes_and_skips_tied_copies(tmp_path: Path) -> None:
    from maec_core.eval.loading import load_model
    from maec_core.io.writer import OutputTensor
    from maec_core.sweep.scoring import ModelSink

    folder = make_llama(tmp_path / "tied", 3, tie_word_embeddings=True)
    loaded = load_model(folder, torch.device("cpu"))
    state = loaded.model.state_dict()
    outs = [OutputTensor(k, tuple(v.shape), "F32") for k, v in state.items()]
    dropped: list[bool] = []
    sink = ModelSink(loaded.model, outs, lambda: dropped.append(True))
    embed = loaded.model.get_input_embeddings().weight
    values = {k: torch.full(v.shape, float(i), dtype=torch.float32)
              for i, (k, v) in enumerate(state.items())}
    for t in outs:
        sink.begin(t.name, t.shape, t.dtype)
        data = values[t.name].reshape(-1).view(torch.uint8).numpy().data.cast("B")
        half = len(data) // 2 // 4 * 4  # two parts, as the engine streams slices
        sink.append(data[:half])
        sink.append(data[half:])
        sink.end()
    assert sink.close() == []
    for name, param in loaded.model.named_parameters():
        assert torch.equal(param, values[name]), name
    # lm_head shares the embeddings: a fresh load keeps the embeddings' values.
    assert torch.equal(loaded.model.lm_head.weight, embed)
    assert torch.equal(embed, values["model.embed_tokens.weight"])
    with pytest.raises(CheckpointError, match="does not have"):
        ModelSink(loaded.model, [*outs, OutputTensor("extra.weight", (2,), "F32")],
                  lambda: None)
    with pytest.raises(CheckpointError, match="lacks"):
        ModelSink(loaded.model, outs[1:], lambda: None)
    wrong = [OutputTensor(t.name, (1, *t.shape), t.dtype) if i == 1 else t
             for i, t in enumerate(outs)]
    with pytest.raises(CheckpointError, match="shape"):
        ModelSink(loaded.model, wrong, lambda: None)
    sink.abort()
    assert dropped == [True]


def test_model_slot_load_checks_names_as_the_sink_does(tmp_path: Path) -> None:
    """A candidate folder read into the slot passes the sink's check: an untied model's
    missing output head is refused before any weight changes, and a tied model's stored
    second name is ignored, as a fresh load ignores it."""
    from safetensors.torch import load_file, save_file

    from maec_core.sweep.scoring import ModelSlot

    untied = make_llama(tmp_path / "untied", 1)
    other = make_llama(tmp_path / "other", 2)
    headless = tmp_path / "headless"
    shutil.copytree(other, headless)
    weights = headless / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["lm_head.weight"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    slot = ModelSlot(torch.device("cpu"))
    model = slot.load(untied).model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"lacks tensors.*lm_head"):
        slot.load(headless)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert slot.load(other).model is model
    assert torch.equal(model.lm_head.weight, load_file(str(other / "model.safetensors"))[
        "lm_head.weight"])

    tied = make_llama(tmp_path / "tied", 3, tie_word_embeddings=True)
    both = tmp_path / "both"
    make_llama(both, 4, tie_word_embeddings=True)
    stored = load_file(str(both / "model.safetensors"))
    embed = stored["model.embed_tokens.weight"]
    # A writer that stored the tied head anyway, with other values.
    save_file({**stored, "lm_head.weight": embed + 1.0}, str(both / "model.safetensors"),
              metadata={"format": "pt"})
    slot.close()
    model = slot.load(tied).model
    slot.load(both)
    assert torch.equal(model.get_input_embeddings().weight, embed)
    assert torch.equal(model.lm_head.weight, embed)
    slot.close()


def test_tie_break_decides_between_equal_objectives(world: dict[str, Path],
                                                    tmp_path: Path) -> None:
    """Every candidate scores 0 on a question set no tiny model can answer: the objective
    ties everywhere. Without a tie-break the first candidate in grid order wins; with
    perplexity on the memorised texts as tie-break, the candidate that carries the
    memorisation does, and the published folder is that candidate's."""
    qa = world["root"] / "qa.jsonl"
    qa.write_text("".join(json.dumps({"question": f"w{i} w{i + 1}", "answer": "987654321"})
                          + "\n" for i in range(3)))
    sets = [*_sets(world), {"name": "qa", "language": "sw", "kind": "accuracy",
                            "path": str(qa), "max_new_tokens": 2}]
    accuracy = {"set": "qa", "metric": "accuracy"}
    plain = _maec(world, {"grid": GRID, "objective": accuracy}, evaluate=sets)
    broken = _maec(world, {"grid": GRID, "objective": accuracy, "tie_break": OBJ},
                   evaluate=sets)
    with torch_threads(1):
        first = run_sweep(plain, tmp_path / "plain", RunContext(device="cpu")).board
        second = run_sweep(broken, tmp_path / "broken", RunContext(device="cpu")).board
    assert {r.scores["qa"] for r in first.rows} == {0.0}
    assert first.winner == "c00" and "decided by grid order" in first.why
    best = min(second.rows, key=lambda r: r.scores["memorised"])
    assert best.id == "c03" and second.winner == "c03"
    assert "decided by perplexity on memorised" in second.why
    assert second.tie_break == {"set": "memorised", "metric": "perplexity", "goal": "min"}
    by_rank = sorted(second.rows, key=lambda r: r.rank or 0)
    assert [r.scores["memorised"] for r in by_rank] == sorted(
        r.scores["memorised"] for r in second.rows)
    published = yaml.safe_load((tmp_path / "broken" / "recipe.yaml").read_text())
    assert published["parameters"]["key_ratio"] == 1.0
    assert published["abilities"][0]["mu"] == 1.0


@pytest.fixture(scope="module")
def held_and_streamed(world: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                      ) -> dict[str, Any]:
    """One MAEC extraction group of three candidates swept twice: with the default
    memory budget (the tiny language base fits) and with a budget of 0. Bytes read
    with ``pread`` from every file, per sweep, by real path."""
    import os
    from collections import Counter

    root = tmp_path_factory.mktemp("resident")
    recipe = _maec(world, {"grid": {"mu": [0.0, 0.5, 1.0]}, "objective": OBJ},
                   parameters={"key_ratio": 0.5, "selection_ratio": 1.0})
    assert len({c.group for c in candidates(recipe)}) == 1
    real = os.preadv
    reads: Counter[str] = Counter()

    def counted(fd: int, buffers: Any, offset: int, *rest: Any) -> int:
        got = real(fd, buffers, offset, *rest)
        reads[os.readlink(f"/proc/self/fd/{fd}")] += got
        return got

    out: dict[str, Any] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "preadv", counted)
        for name, budget in (("held", None), ("streamed", 0)):
            reads.clear()
            with torch_threads(1):
                out[name] = run_sweep(recipe, root / name / "out", RunContext(
                    device="cpu", artifact_store=LocalArtifactStore(root / name / "st")),
                    SweepOptions(resident_budget=budget))
            out[name + "_reads"] = dict(reads)
            out[name + "_store"] = root / name / "st"
    return out


def _data_bytes(path: Path) -> int:
    from maec_core.io.headers import read_header

    header = read_header(path)
    return header.size - header.data_start


def test_language_base_read_once_per_sweep_when_it_fits(
        world: dict[str, Path], held_and_streamed: dict[str, Any]) -> None:
    import os

    lang = os.path.realpath(world["lang"] / "model.safetensors")
    size = _data_bytes(world["lang"] / "model.safetensors")
    # Held: θL's tensors read once, before the first candidate; every merge (the first
    # candidate's c_t key rows included, and the winner's final merge) took them from
    # memory.
    assert held_and_streamed["held_reads"][lang] == size
    # Budget 0: read by every candidate's merge, as separate jobs read it.
    assert held_and_streamed["streamed_reads"][lang] >= 3 * size
    # The group's stored ability vectors were held for its second and third candidates:
    # read once for both (the winner's final merge reads them again), not by each.
    def stored(name: str) -> int:
        store = os.path.realpath(held_and_streamed[name + "_store"])
        return sum(n for p, n in held_and_streamed[name + "_reads"].items()
                   if p.startswith(store + os.sep))

    art = next(held_and_streamed["held_store"].glob("*/ability.safetensors"))
    assert _data_bytes(art) <= stored("held") < stored("streamed")


def test_held_language_base_changes_no_score_and_no_byte(
        held_and_streamed: dict[str, Any]) -> None:
    held, streamed = held_and_streamed["held"], held_and_streamed["streamed"]
    assert {r.id: r.scores for r in held.board.rows} == {
        r.id: r.scores for r in streamed.board.rows}
    assert held.board.winner == streamed.board.winner
    # Every file of the winner but those recording the run (timings, what was held).
    facts = {"leaderboard.json", "eval_report.json", "README.md", "manifest.json"}
    names = {p.name for p in held.out_dir.iterdir()}
    assert names == {p.name for p in streamed.out_dir.iterdir()}
    assert {"model.safetensors", "maec_report.json"} <= names - facts
    for name in sorted(names - facts):
        assert (held.out_dir / name).read_bytes() == (
            streamed.out_dir / name).read_bytes(), name
    _verifies(held.out_dir)


def test_board_says_whether_the_language_base_was_held(
        world: dict[str, Path], held_and_streamed: dict[str, Any]) -> None:
    size = _data_bytes(world["lang"] / "model.safetensors")
    for name, was_held in (("held", True), ("streamed", False)):
        result = held_and_streamed[name]
        on_disk = read_leaderboard(result.out_dir / "leaderboard.json")
        assert on_disk.resident == result.board.resident
        res = on_disk.resident
        assert res is not None and res.language_base is was_held
        assert res.language_base_bytes == size
        assert res.ability_vector_groups == (1 if was_held else 0)
        assert (res.budget_bytes == 0) is not was_held
        card = (result.out_dir / "README.md").read_text()
        assert res.sentence() in card
        assert ("read from disk once for all candidates" in card) is was_held
    json_board = json.loads((held_and_streamed["held"].out_dir / "leaderboard.json")
                            .read_text())
    assert json_board["resident"]["language_base"] is True


def _tiny_mixtral(path: Path, seed: int, like: Path | None = None) -> Path:
    """A seeded two-expert Mixtral: its checkpoint stores each expert's weights by name,
    which transformers fuses into one tensor per layer as it loads."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=tiny_tokenizer().vocab_size, hidden_size=32,
                        intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1,
                        max_position_embeddings=64)
    model = MixtralForCausalLM(cfg)
    if like is not None:
        base = MixtralForCausalLM.from_pretrained(like, dtype=torch.float32)
        with torch.no_grad():
            for p, q in zip(model.parameters(), base.parameters(), strict=True):
                p.copy_(q + 0.02 * torch.randn_like(q))
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def test_a_model_whose_checkpoint_names_transformers_converts_is_swept_from_folders(
        world: dict[str, Path], tmp_path: Path) -> None:
    """Mixtral's checkpoint names its experts one by one; the loaded model holds them
    fused. No candidate can be merged into that model by name, so the sweep writes and
    loads each one, as a separate evaluation does: the same scores, the extraction
    counted once, and nothing left behind."""
    from maec_core.eval.runner import evaluate
    from maec_core.run import run
    from maec_core.sweep.inputs import eval_spec

    base = _tiny_mixtral(tmp_path / "m-base", 0)
    donor = _tiny_mixtral(tmp_path / "m-donor", 1, like=base)
    lang = _tiny_mixtral(tmp_path / "m-lang", 2, like=base)
    recipe = parse_recipe({
        "merge_method": "maec", "base_model": str(base), "language_base": str(lang),
        "abilities": [{"model": str(donor)}], "parameters": {"selection_ratio": 1.0},
        "evaluate": _sets(world)[:1],
        "sweep": {"grid": {"key_ratio": [0.5], "mu": [0.5, 1.0]}, "objective": OBJ}})
    work = tmp_path / "work"
    with torch_threads(1):
        result = run_sweep(recipe, tmp_path / "out", RunContext(device="cpu"),
                           SweepOptions(work_dir=work))
        board = result.board
        assert result.extractions == 1 and [r.extracted for r in board.rows] == [True, False]
        store = LocalArtifactStore(tmp_path / "store")
        for cand in candidates(recipe):
            run(cand.recipe, tmp_path / cand.id, RunContext(artifact_store=store, device="cpu"))
            alone = evaluate(tmp_path / cand.id, eval_spec(recipe), RunContext(device="cpu"))
            assert board.row(cand.id).scores == {s.name: s.value
                                                 for s in alone.models[0].sets}
        # Candidates written anyway (publish: all) are loaded afresh the same way.
        every = run_sweep(recipe.model_copy(update={"sweep": recipe.sweep.model_copy(
            update={"publish": "all"})}), tmp_path / "all", RunContext(device="cpu"),
            SweepOptions(work_dir=work)).board  # type: ignore[union-attr]
        assert [r.scores for r in every.rows] == [r.scores for r in board.rows]
    assert list(work.iterdir()) == []
    assert (tmp_path / "out" / "leaderboard.json").is_file()
