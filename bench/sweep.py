"""Benchmark: a MAEC sweep against the same candidates run as separate evaluated jobs.

Three small local Llama checkpoints (built once under bench/cache/, never downloaded):
θ0, a language base and an ability donor (θ0 plus seeded noise), and two eval sets (a
perplexity set and a question/answer set). The sweep is 2 key_ratios x 3 mu: six
candidates, two ability vectors. Measured at two levels, each side from an empty
artifact store, the sides interleaved over ``--runs`` rounds (ratio of medians), every
candidate's scores checked equal on both sides (and across levels):

jobs (the RESULT's ratio): the real service, started once (bench/sweep_jobs.py: its own
  redis-server, one Celery worker with concurrency 1, the API, local-directory storage).
  The sweep is ONE job (its recipe with the ``sweep:`` block, ``publish: best``); the
  peer is six jobs, each one candidate's recipe with the same ``evaluate`` list, submitted
  one after another, each waited to its end; its wall is their sum. A job's wall is the
  client's, from sending the POST to the poll (every 20 ms) that sees it terminal, so it
  holds submission checks, queueing, the claim (each job in a fresh worker child),
  fetching inputs, merging, evaluating, publishing (checksums, manifest, model card, eval
  report) and every status write; the record's created -> finished span is checked
  against it. The peer is the conservative one: its jobs run on the SAME warm worker,
  with every reuse the service gives jobs - the worker's input cache is warm, and the
  ability vector the first job of a key_ratio extracts is stored and reused by the two
  after it, as it would be for a caller submitting them. Between sides, the jobs are
  deleted and every stored ability vector removed (storage and the worker's local
  copies), and each side must report exactly two extractions. One untimed warm-up job
  (a one-point sweep: fetch, extract, merge, evaluate, plot, publish) runs first.
library: both sides as calls in this process: ``run_sweep`` against six ``run`` +
  ``evaluate``, each of those with its own empty artifact store (six extractions, as six
  cold workers would do), after a warm-up (imports, first model load, matplotlib).
  What it leaves out is everything a job costs beyond merge + evaluate.

MAEC's importance is the method's default (``delta``: extraction reads weights only, so
evaluation dominates both sides) unless ``--importance`` says otherwise; ``both`` also
measures ``gradient`` (a corpus pass per extraction), about four times as long, and
reports it first.

    .venv/bin/python -m bench.sweep [--runs 3] [--level both] [--importance delta]

Each level's line gives both sides' median walls and their ratio, and the CPU seconds each
side used (library: this process; jobs: the stack's API, Redis and worker processes,
answering the polls included): on a machine shared with other work the walls swing with
its load and CPU seconds much less, so a wall ratio far from the CPU one says the machine
was busy, not that either side changed. The job level also prints its seconds by phase.
The jobs line comes first, the library line just before the last line, which is exactly
one, for the default importance (or the one asked for), from the job level when measured:
RESULT sweep candidates=6 extractions=<n> wall_ratio_vs_separate_jobs=<sweep/separate>
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import CACHE, median
from maec_core.context import RunContext

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



Scores = dict[str, dict[str, float]]


@dataclass
class Round:
    """One side's one run: its wall, every candidate's scores, and (job level) where the
    time went, summed over the side's jobs."""

    wall: float
    scores: Scores
    extractions: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    # Job level: the engine's own seconds as the job records say (core_seconds).
    engine: float = 0.0
    # CPU seconds spent meanwhile: this process's (library) or the stack's (jobs).
    cpu: float = 0.0


@dataclass
class Level:
    """Both sides of one level (library or jobs) at one importance, over every run."""

    level: str
    importance: str
    sweep: list[Round] = field(default_factory=list)
    separate: list[Round] = field(default_factory=list)

    def median(self, side: str) -> float:
        return median([r.wall for r in getattr(self, side)])

    @property
    def ratio(self) -> float:
        return self.median("sweep") / self.median("separate")

    def cpu(self, side: str) -> float:
        return median([r.cpu for r in getattr(self, side)])

    def line(self) -> str:
        return (f"{self.level}-level, importance {self.importance}: sweep "
                f"{self.median('sweep'):.2f} s, separate jobs {self.median('separate'):.2f} s "
                f"(medians of {len(self.sweep)}), ratio {self.ratio:.3f}; CPU "
                f"{self.cpu('sweep'):.2f} s against {self.cpu('separate'):.2f} s, ratio "
                f"{self.cpu('sweep') / self.cpu('separate'):.3f}")


# -- library level: both sides as calls in this process --------------------------------

def library_sweep(data: dict[str, Any]) -> Round:
    """One sweep with a fresh artifact store."""
    from maec_core.artifact_store import LocalArtifactStore
    from maec_core.parsing import parse_recipe
    from maec_core.sweep.runner import run_sweep

    recipe = parse_recipe(data)
    with tempfile.TemporaryDirectory(prefix="maec-bench-sweep-") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        result = run_sweep(recipe, work / "out", RunContext(artifact_store=LocalArtifactStore(
            work / "store"), device="cpu", hash_cache=work / "sha"))
        wall = time.perf_counter() - t0
    return Round(wall, {r.id: r.scores for r in result.board.rows}, result.extractions)


def library_separate(data: dict[str, Any]) -> Round:
    """Each candidate run and evaluated as on a cold worker: its own empty artifact
    store, so each extracts its ability vector."""
    from maec_core.artifact_store import LocalArtifactStore
    from maec_core.eval.runner import evaluate
    from maec_core.parsing import parse_recipe
    from maec_core.run import run
    from maec_core.sweep.grid import candidates
    from maec_core.sweep.inputs import eval_spec

    recipe = parse_recipe(data)
    total, scores = 0.0, {}
    with tempfile.TemporaryDirectory(prefix="maec-bench-sweep-") as tmp:
        for cand in candidates(recipe):
            job = Path(tmp) / cand.id
            t0 = time.perf_counter()
            run(
                cand.recipe,
                job / "out",
                RunContext(
                    artifact_store=LocalArtifactStore(job / "store"),
                    device="cpu",
                    hash_cache=job / "sha",
                ),
            )
            report = evaluate(
                job / "out", eval_spec(recipe), RunContext(device="cpu"), label=cand.id
            )
            total += time.perf_counter() - t0
            scores[cand.id] = {s.name: s.value for s in report.models[0].sets}
            shutil.rmtree(job)
    return Round(total, scores, len(scores))


def library_warm_up(data: dict[str, Any], inputs: dict[str, Path]) -> None:
    """One-time costs paid before either side is timed, as a long-lived worker has paid
    them: imports, the first model load and generation, matplotlib's first figure."""
    from maec_core.eval.runner import evaluate
    from maec_core.parsing import parse_recipe
    from maec_core.sweep.board import Leaderboard, Row
    from maec_core.sweep.inputs import eval_spec
    from maec_core.sweep.plot import plot_png

    evaluate(inputs["lang"], eval_spec(parse_recipe(data)), RunContext(device="cpu"))
    row = Row(id="c00", values={"mu": 1.0}, scores={"s": 1.0}, objective=1.0, rank=1)
    plot_png(Leaderboard(knobs=["mu"], objective={"set": "s", "metric": "perplexity"},
                         rows=[row], winner="c00", why="warm-up"))


def measure_library(data: dict[str, Any], inputs: dict[str, Path], runs: int) -> Level:
    library_warm_up(data, inputs)
    return interleave(Level("library", data["parameters"]["importance"]), runs,
                      lambda: library_sweep(data), lambda: library_separate(data),
                      cpu=time.process_time)


# -- job level: both sides as jobs of the real stack ------------------------------------

def jobs_sweep(client: Any, data: dict[str, Any]) -> Round:
    """The sweep as one job, from an empty artifact store."""
    from bench.sweep_jobs import groups, sweep_body, sweep_scores

    job = client.run(sweep_body(data))
    extractions = int(job.job["result"]["sweep"]["extractions"])
    if extractions != groups(data):
        raise RuntimeError(f"the sweep extracted {extractions} ability vectors, not "
                           f"{groups(data)}: the artifact store was not empty")
    return Round(job.wall, sweep_scores(job), extractions, {"submit": job.post, **job.phases},
                 job.engine)


def jobs_separate(client: Any, data: dict[str, Any]) -> Round:
    """Each candidate as its own evaluated job, one after another on the same worker,
    from an empty artifact store (later jobs of a key_ratio reuse the first's vector)."""
    from bench.sweep_jobs import candidate_bodies, groups, merged_scores

    total, scores, extracted, engine = 0.0, {}, 0, 0.0
    phases: dict[str, float] = {}
    for cid, body in candidate_bodies(data).items():
        job = client.run(body)
        total += job.wall
        engine += job.engine
        scores[cid] = merged_scores(job)
        extracted += job.job["artifact_reused"] is False
        for k, v in {"submit": job.post, **job.phases}.items():
            phases[k] = phases.get(k, 0.0) + v
    if extracted != groups(data):
        raise RuntimeError(f"the separate jobs extracted {extracted} ability vectors, not "
                           f"{groups(data)}: the artifact store was not empty")
    return Round(total, scores, extracted, phases, engine)


def measure_jobs(client: Any, data: dict[str, Any], runs: int) -> Level:
    from bench.sweep_jobs import clear_artifacts, service_cpu, sweep_body

    # Warm-up, not timed: a one-point sweep runs every step either side's jobs run
    # (fetch into the worker's cache, extract, combine, evaluate, plot, publish).
    one = {**data, "sweep": {**data["sweep"],
                             "grid": {k: v[:1] for k, v in data["sweep"]["grid"].items()}}}
    client.run(sweep_body(one))

    def reset() -> None:
        # Each side from an empty artifact store, the earlier jobs (and their outputs)
        # deleted: outside the timed and CPU-counted span.
        client.forget()
        clear_artifacts(client.stack)

    level = interleave(Level("jobs", data["parameters"]["importance"]), runs,
                       lambda: jobs_sweep(client, data), lambda: jobs_separate(client, data),
                       cpu=lambda: service_cpu(client.stack), reset=reset)
    for side in ("sweep", "separate"):
        rounds = getattr(level, side)
        names = dict.fromkeys(k for r in rounds for k in r.phases)
        shown = "  ".join(f"{k} {median([r.phases.get(k, 0.0) for r in rounds]):.2f}"
                          for k in names)
        print(f"jobs-level {side:8s} seconds by phase (medians): {shown}; the engine's "
              f"own {median([r.engine for r in rounds]):.2f}", flush=True)
    return level


def interleave(level: Level, runs: int, sweep: Callable[[], Round],
               separate: Callable[[], Round], *, cpu: Callable[[], float],
               reset: Callable[[], None] = lambda: None) -> Level:
    """Both sides ``runs`` times, the order alternating, each after ``reset``; ``cpu``
    (a clock of CPU seconds) read around each; every run's scores checked."""
    for i in range(runs):
        order = ["sweep", "separate"] if i % 2 == 0 else ["separate", "sweep"]
        for side in order:
            reset()
            before = cpu()
            r = sweep() if side == "sweep" else separate()
            r.cpu = cpu() - before
            getattr(level, side).append(r)
            print(f"{level.level} run {i + 1} {side:8s} wall {r.wall:6.2f} s", flush=True)
        _same_scores(level.sweep[-1].scores, level.separate[-1].scores)
    return level


def _same_scores(ours: Scores, theirs: Scores) -> None:
    """The sweep scores every candidate exactly as a separate job would."""
    assert ours.keys() == theirs.keys(), (ours.keys(), theirs.keys())
    for cid, scores in ours.items():
        for name, value in scores.items():
            assert abs(value - theirs[cid][name]) <= 1e-6 * max(1.0, abs(value)), (
                cid, name, value, theirs[cid][name])


def main() -> None:
    from maec_core.maec.params import MaecParams
    from maec_core.runtime import torch_threads

    default = str(MaecParams.model_fields["importance"].default)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--level", choices=["jobs", "library", "both"], default="both",
                        help="jobs: both sides as jobs of the real stack; library: as "
                             "calls in this process; both (RESULT from jobs)")
    parser.add_argument("--importance", choices=["gradient", "delta", "both"],
                        default=default,
                        help=f"MAEC's importance (default: the method's, {default}): "
                             "gradient (a corpus pass per extraction), delta (weights "
                             f"only; extraction is cheap), or both (RESULT for {default})")
    args = parser.parse_args()
    inputs = ensure_inputs()
    # The RESULT line's importance goes last.
    modes = [m for m in ("gradient", "delta") if m != default] + [default] \
        if args.importance == "both" else [args.importance]
    datas = [recipe_data(inputs, mode) for mode in modes]
    measured: list[Level] = []
    if args.level in ("library", "both"):
        with torch_threads(args.threads):
            measured += [measure_library(data, inputs, args.runs) for data in datas]
    if args.level in ("jobs", "both"):
        measured += run_jobs_level(datas, args.runs, args.threads)
    for mode in modes:
        # Per importance the job level's line, then the library level's (so, for the
        # RESULT's importance, the line before RESULT).
        levels = sorted((m for m in measured if m.importance == mode),
                        key=lambda m: m.level != "jobs")
        if len(levels) == 2:
            # The same candidates and code: a job scores them as the library does.
            _same_scores(levels[0].sweep[-1].scores, levels[1].sweep[-1].scores)
        print(f"importance {mode}: every candidate's scores equal on both sides of "
              + " and ".join(f"the {lv.level} level" for lv in levels)
              + (", and across levels" if len(levels) == 2 else ""))
        for lv in levels:
            print(lv.line())
    final = levels[0]  # the RESULT's importance; jobs when measured
    print(f"RESULT sweep candidates={len(final.sweep[-1].scores)} "
          f"extractions={final.sweep[-1].extractions} "
          f"wall_ratio_vs_separate_jobs={final.ratio:.3f}")


def run_jobs_level(datas: list[dict[str, Any]], runs: int, threads: int) -> list[Level]:
    """Every importance's job-level measurement on one stack, stopped afterwards."""
    from bench.sweep_jobs import Client, started_stack

    with tempfile.TemporaryDirectory(prefix="maec-bench-sweep-stack-") as tmp, \
            started_stack(Path(tmp), MODELS, threads) as stack:
        client = Client(stack)
        try:
            return [measure_jobs(client, data, runs) for data in datas]
        finally:
            client.close()


if __name__ == "__main__":
    main()
