"""Benchmark: a MAEC sweep against the same candidates run as separate evaluated jobs.

Three small local Llama checkpoints (built once under bench/cache/, never downloaded):
θ0, a language base and an ability donor (θ0 plus seeded noise), and two eval sets (a
perplexity set and a question/answer set). The sweep is 2 key_ratios x 3 mu. The peer is
what six separate jobs on cold workers do: each runs ``maec_core.run.run`` with its own
empty artifact store (so each extracts its ability vector) and then ``evaluate`` on the
merged folder. Both sides run in this process, on the same threads, interleaved over
``--runs`` rounds; the ratio is of medians. Both sides must agree on every candidate's
scores (checked).

MAEC's importance is the method's default (``delta``: extraction reads weights only, so
evaluation dominates both sides) unless ``--importance`` says otherwise; ``both`` also
measures ``gradient`` (a corpus pass per extraction, which six separate jobs repeat six
times), about four times as long, and reports it on the line before the RESULT.

    .venv/bin/python -m bench.sweep [--runs 1] [--threads 1] [--importance both]

Ends with exactly one line, for the default importance (or the one asked for):
RESULT sweep candidates=6 extractions=<n> wall_ratio_vs_separate_jobs=<sweep/separate>
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import CACHE, median

MODELS = CACHE / "sweep-models"
VOCAB = 2000
SHAPE: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 704,
                         "num_hidden_layers": 6, "num_attention_heads": 8,
                         "num_key_value_heads": 4, "max_position_embeddings": 256}
GRID = {"key_ratio": [0.05, 0.1], "mu": [0.5, 1.0, 1.5]}
DOCS, DOC_WORDS, QUESTIONS = 4, 300, 8
# importance: gradient reads this many corpus tokens per extraction.
TOKEN_BUDGET = 8192


def _tokenizer() -> Any:
    from tests.factories import bos_tokenizer

    return bos_tokenizer({"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3,
                          **{f"t{i}": i + 4 for i in range(VOCAB - 14)},
                          **{str(d): VOCAB - 10 + d for d in range(10)}})


def ensure_inputs() -> dict[str, Path]:
    """θ0, θL = θ0 + noise, θA = θ0 + noise (seeded), and the two eval sets."""
    paths = {k: MODELS / k for k in ("base", "lang", "donor")}
    sets = MODELS / "sets"
    if (sets / "corpus.txt").exists():
        return {**paths, "sets": sets}
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                      **SHAPE)
    base = LlamaForCausalLM(cfg)
    for i, (name, path) in enumerate(paths.items()):
        model = base if name == "base" else LlamaForCausalLM(cfg)
        if name != "base":
            gen = torch.Generator().manual_seed(i)
            with torch.no_grad():
                for p, q in zip(model.parameters(), base.parameters(), strict=True):
                    p.copy_(q + 0.02 * torch.randn(q.shape, generator=gen))
        model.save_pretrained(path)
        _tokenizer().save_pretrained(path)
    rng = random.Random(0)
    sets.mkdir(parents=True, exist_ok=True)
    with open(sets / "text.jsonl", "w") as f:
        for _ in range(DOCS):
            words = " ".join(f"t{rng.randrange(VOCAB - 14)}" for _ in range(DOC_WORDS))
            f.write(json.dumps({"text": words}) + "\n")
    with open(sets / "qa.jsonl", "w") as f:
        for _ in range(QUESTIONS):
            question = " ".join(f"t{rng.randrange(VOCAB - 14)}" for _ in range(12))
            f.write(json.dumps({"question": question, "answer": str(rng.randrange(10))}) + "\n")
    with open(sets / "corpus.txt", "w") as f:
        for _ in range(TOKEN_BUDGET // 200 + 4):
            f.write(" ".join(f"t{rng.randrange(VOCAB - 14)}" for _ in range(200)) + "\n\n")
    return {**paths, "sets": sets}


def recipe_data(inputs: dict[str, Path], importance: str) -> dict[str, Any]:
    sets = inputs["sets"]
    ability: dict[str, Any] = {"model": str(inputs["donor"])}
    params: dict[str, Any] = {"selection_ratio": 0.5, "importance": importance}
    if importance == "gradient":
        ability["corpus"] = str(sets / "corpus.txt")
        params.update({"token_budget": TOKEN_BUDGET, "seq_len": 128, "batch_size": 8})
    return {
        "merge_method": "maec", "base_model": str(inputs["base"]),
        "language_base": str(inputs["lang"]), "abilities": [ability],
        "parameters": params,
        "evaluate": [
            {"name": "text-sw", "language": "sw", "kind": "perplexity",
             "path": str(sets / "text.jsonl"), "context": 128, "stride": 64},
            {"name": "qa-sw", "language": "sw", "kind": "accuracy",
             "path": str(sets / "qa.jsonl"), "max_new_tokens": 8}],
        "sweep": {"grid": GRID, "objective": {"set": "text-sw", "metric": "perplexity"}},
    }


def run_sweep_once(data: dict[str, Any], work: Path) -> tuple[float, int, dict[str, Any]]:
    """One sweep with a fresh artifact store: (wall seconds, extractions, scores)."""
    from maec_core.maec.store import LocalArtifactStore
    from maec_core.recipe import parse_recipe
    from maec_core.sweep.runner import run_sweep

    recipe = parse_recipe(data)
    t0 = time.perf_counter()
    result = run_sweep(recipe, work / "out", artifact_store=LocalArtifactStore(
        work / "store"), device="cpu", hash_cache=work / "sha")
    wall = time.perf_counter() - t0
    scores = {r.id: r.scores for r in result.board.rows}
    return wall, result.extractions, scores


def run_separate_once(data: dict[str, Any], work: Path) -> tuple[float, dict[str, Any]]:
    """Each candidate as its own evaluated job on a cold worker: (summed wall, scores)."""
    from maec_core.eval.runner import evaluate
    from maec_core.maec.store import LocalArtifactStore
    from maec_core.recipe import parse_recipe
    from maec_core.run import run
    from maec_core.sweep.grid import candidates
    from maec_core.sweep.inputs import eval_spec

    recipe = parse_recipe(data)
    total, scores = 0.0, {}
    for cand in candidates(recipe):
        job = work / cand.id
        t0 = time.perf_counter()
        run(cand.recipe, job / "out", artifact_store=LocalArtifactStore(job / "store"),
            device="cpu", hash_cache=job / "sha")
        report = evaluate(job / "out", eval_spec(recipe), device="cpu", label=cand.id)
        total += time.perf_counter() - t0
        scores[cand.id] = {s.name: s.value for s in report.models[0].sets}
        shutil.rmtree(job)
    return total, scores


def main() -> None:
    from maec_core.maec.params import MaecParams

    default = str(MaecParams.model_fields["importance"].default)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--importance", choices=["gradient", "delta", "both"],
                        default=default,
                        help=f"MAEC's importance (default: the method's, {default}): "
                             "gradient (a corpus pass per extraction), delta (weights "
                             f"only; extraction is cheap), or both (RESULT for {default})")
    args = parser.parse_args()
    from maec_core.runtime import torch_threads

    inputs = ensure_inputs()
    asked = args.importance
    # The RESULT line's importance goes last.
    modes = [m for m in ("gradient", "delta") if m != default] + [default] \
        if asked == "both" else [asked]
    with torch_threads(args.threads):
        for mode in modes:
            ratio, candidates, extractions = measure(recipe_data(inputs, mode), inputs,
                                                     args.runs)
    print(f"RESULT sweep candidates={candidates} extractions={extractions} "
          f"wall_ratio_vs_separate_jobs={ratio:.3f}")


def measure(data: dict[str, Any], inputs: dict[str, Path], runs: int
            ) -> tuple[float, int, int]:
    """Both sides ``runs`` times, interleaved: (ratio of medians, candidates,
    extractions of the sweep)."""
    sweep_walls: list[float] = []
    separate_walls: list[float] = []
    extractions = 0
    warm_up(data, inputs)
    for i in range(runs):
        order = ["sweep", "separate"] if i % 2 == 0 else ["separate", "sweep"]
        for side in order:
            with tempfile.TemporaryDirectory(prefix="maec-bench-sweep-") as tmp:
                if side == "sweep":
                    wall, extractions, ours = run_sweep_once(data, Path(tmp))
                    sweep_walls.append(wall)
                else:
                    wall, theirs = run_separate_once(data, Path(tmp))
                    separate_walls.append(wall)
            print(f"run {i + 1} {side:8s} wall {wall:6.2f} s", flush=True)
        _same_scores(ours, theirs)
    ratio = median(sweep_walls) / median(separate_walls)
    print(f"importance {data['parameters']['importance']}: sweep {median(sweep_walls):.2f} s, "
          f"separate jobs {median(separate_walls):.2f} s (medians of {runs}), "
          f"ratio {ratio:.3f}", flush=True)
    return ratio, len(ours), extractions


def warm_up(data: dict[str, Any], inputs: dict[str, Path]) -> None:
    """One-time costs paid before either side is timed, as a long-lived worker has paid
    them: imports, the first model load and generation, matplotlib's first figure."""
    from maec_core.eval.runner import evaluate
    from maec_core.recipe import parse_recipe
    from maec_core.sweep.board import Leaderboard, Row
    from maec_core.sweep.inputs import eval_spec
    from maec_core.sweep.plot import plot_png

    evaluate(inputs["lang"], eval_spec(parse_recipe(data)), device="cpu")
    row = Row(id="c00", values={"mu": 1.0}, scores={"s": 1.0}, objective=1.0, rank=1)
    plot_png(Leaderboard(knobs=["mu"], objective={"set": "s", "metric": "perplexity"},
                         rows=[row], winner="c00", why="warm-up"))


def _same_scores(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """The sweep scores every candidate exactly as a separate job would."""
    assert ours.keys() == theirs.keys(), (ours.keys(), theirs.keys())
    for cid, scores in ours.items():
        for name, value in scores.items():
            assert abs(value - theirs[cid][name]) <= 1e-6 * max(1.0, abs(value)), (
                cid, name, value, theirs[cid][name])


if __name__ == "__main__":
    main()
