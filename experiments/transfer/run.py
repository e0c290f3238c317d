"""The transfer experiment end to end: data, training (cached), merges, evaluation, report.

Targets T, T′ and T′x; abilities A (word problems) and B (comparisons), merged one at a time
and together; every sweep chosen on accuracy alone and under the fluency constraint.

    python -m experiments.transfer.run --full    # 3 seeds, the sweep, docs/experiments/*.png
    python -m experiments.transfer.run --smoke   # 1 seed, small budget, ends with a RESULT line
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM

from experiments.transfer import evalsets as E
from experiments.transfer import lang
from experiments.transfer import model as M
from experiments.transfer.config import DEBUG, FULL, PPL_RATIO, SMOKE, Config
from experiments.transfer.lang import ProblemSplits
from experiments.transfer.merges import (
    OBJECTIVE_SET,
    Checkpoints,
    Swept,
    discard,
    extvocab_recipes,
    sweep,
    sweep_recipes,
)
from maec_core.context import RunContext
from maec_core.eval import EvalReport, EvalSetSpec, EvalSpec
from maec_core.runtime import torch_threads

HERE = Path(__file__).resolve().parent
CACHE = HERE / "cache"
# Input digests and MAEC ability artifacts, reused across candidates and runs.
MAEC_CACHE = Path(os.environ.get("MAEC_CACHE_DIR") or CACHE / "maec")
ROOT = HERE.parent.parent



def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------


@dataclass
class SeedData:
    problems: ProblemSplits  # ability A: two-step word problems
    comparisons: ProblemSplits  # ability B: the larger of two counts
    # Held-out general text per target language ("T", "R", "X"): (validation, test).
    docs: dict[str, tuple[list[list[str]], list[list[str]]]]
    align_pairs: list[tuple[list[str], list[str]]]
    align_pairs_r: list[tuple[list[str], list[str]]]


def seed_data(cfg: Config, seed: int) -> SeedData:
    probs = lang.problem_splits(seed, cfg.n_train, cfg.n_val, cfg.n_test)
    # Held-out T text from its own RNG stream; training draws from random.Random(seed+...)
    # streams, and with a 6×6×8×16-sized sentence space some overlap is unavoidable and
    # the same for every compared model.
    docs = {}
    for offset, target in ((10_000, "T"), (30_000, "R"), (50_000, "X")):
        rng = random.Random(offset + seed)
        d = [lang.general_document(rng, target, cfg.seq_len - 2)
             for _ in range(2 * cfg.n_ppl_docs)]
        docs[target] = (d[: cfg.n_ppl_docs], d[cfg.n_ppl_docs:])
    prng = random.Random(20_000 + seed)
    clauses = [lang.random_clause(prng) for _ in range(cfg.n_align_pairs)]
    comparisons = lang.comparison_splits(seed, cfg.n_train, cfg.n_val, cfg.n_test)
    return SeedData(probs, comparisons, docs,
                    [(c.realise("S"), c.realise("T")) for c in clauses],
                    [(c.realise("S"), c.realise("R")) for c in clauses])


def base_sampler(cfg: Config) -> lang.Sampler:
    m, n = cfg.mix, cfg.seq_len - 2
    return lang.mixture([
        (m.s_text, lambda r: lang.general_document(r, "S", n)),
        (m.t_text, lambda r: lang.general_document(r, "T", n)),
        (m.s_gloss, lambda r: lang.gloss_example(r, "S")),
        (m.t_gloss, lambda r: lang.gloss_example(r, "T")),
        (m.r_text, lambda r: lang.general_document(r, "R", n)),
        (m.r_gloss, lambda r: lang.gloss_example(r, "R")),
        (m.translation, lambda r: lang.translation_example(r, r.choice(lang.LANGS))),
        (m.arithmetic, lang.arithmetic_example),
        (m.code_switch, lambda r: lang.code_switched_example(r, r.choice(lang.LANGS))),
    ])


def ability_sampler(train: Sequence[lang.Item]) -> lang.Sampler:
    return lambda r: r.choice(train).text("S")


# ---------------------------------------------------------------------------------------
# training (cached)
# ---------------------------------------------------------------------------------------


def trained(cfg: Config, stage: str, seed: int, make: Callable[[], LlamaForCausalLM],
            spec: M.TrainSpec, sampler: lang.Sampler, train_seed: int,
            vocab: M.Vocab = M.VOCAB) -> Path:
    path = CACHE / "checkpoints" / cfg.stage_key(stage, seed)
    if M.is_complete(path):
        log(f"seed {seed}: {stage} cached at {path.name}")
        return path
    model = make()
    t0 = time.perf_counter()
    losses = M.train(model, sampler, spec, train_seed, cfg.seq_len, progress=lambda n, loss:
                     log(f"seed {seed}: {stage} step {n}/{spec.steps} loss {loss:.3f}"),
                     vocab=vocab)
    secs = time.perf_counter() - t0
    tail = losses[-50:]
    log(f"seed {seed}: trained {stage} in {secs:.0f}s, final loss {sum(tail) / len(tail):.3f}")
    M.save(model, path, {"stage": stage, "seed": seed, "spec": spec.as_dict(),
                         "seconds": secs, "final_loss": sum(tail) / len(tail)}, vocab)
    return path


def checkpoints_base(cfg: Config, seed: int) -> Path:
    """θ0 for ``seed`` (the first seed's, shared, unless ``base_per_seed``)."""
    base_seed = seed if cfg.base_per_seed else cfg.seeds[0]

    def fresh() -> LlamaForCausalLM:
        model = M.new_model(cfg.size, base_seed)
        if cfg.aligned_init:
            M.copy_rows(model, [(lang.word(c, "R"), lang.word(c, "S")) for c in lang.LEXICON])
        return model

    return trained(cfg, "theta0", seed, fresh, cfg.base, base_sampler(cfg), base_seed)


def donor_a(cfg: Config, seed: int, data: SeedData, theta0: Path) -> Path:
    """θA: θ0 fine-tuned on ability A's S word problems (loss on the answer)."""
    return trained(cfg, "thetaA", seed, lambda: M.load(theta0), cfg.ability,
                   ability_sampler(data.problems.train), 100 + seed)


def language_base(cfg: Config, seed: int, target: str, theta0: Path) -> Path:
    """θL (``target`` "T") or θL′ ("R"): θ0 fine-tuned on general text of the target."""
    stage, offset = {"T": ("thetaL", 300), "R": ("thetaLR", 400)}[target]
    n = cfg.seq_len - 2
    return trained(cfg, stage, seed, lambda: M.load(theta0), cfg.language,
                   lambda r: lang.general_document(r, target, n), offset + seed)


def checkpoints(cfg: Config, seed: int, data: SeedData) -> Checkpoints:
    theta0 = checkpoints_base(cfg, seed)

    def from_base() -> LlamaForCausalLM:
        return M.load(theta0)

    n = cfg.seq_len - 2
    thetaA = donor_a(cfg, seed, data, theta0)
    thetaS = trained(cfg, "thetaS", seed, from_base, cfg.control,
                     lambda r: lang.general_document(r, "S", n), 200 + seed)
    thetaL = language_base(cfg, seed, "T", theta0)
    thetaLR = language_base(cfg, seed, "R", theta0)
    # The second ability's donor: the same recipe as θA's on ability B's S items.
    thetaB = trained(cfg, "thetaB", seed, from_base, cfg.ability,
                     ability_sampler(data.comparisons.train), 500 + seed)

    def extended() -> LlamaForCausalLM:
        # T′x's new tokens start as copies of their S counterparts' rows (a bilingual
        # dictionary's initialisation), then the fine-tune trains them with the layers.
        return M.extend_vocabulary(M.load(theta0), M.XVOCAB, [
            (lang.word(c, "X"), lang.word(c, "S")) for c in lang.LEXICON])

    thetaLX = trained(cfg, "thetaLX", seed, extended, cfg.language_ext,
                      lambda r: lang.general_document(r, "X", n), 600 + seed, M.XVOCAB)
    corpus = CACHE / "corpus" / f"ability-S-seed{seed}-n{cfg.n_train}.jsonl"
    corpus.parent.mkdir(parents=True, exist_ok=True)
    with open(corpus, "w", encoding="utf-8") as f:
        for p in data.problems.train:
            f.write(json.dumps({"text": " ".join(p.text("S"))}) + "\n")
    return Checkpoints(theta0, thetaA, thetaS, thetaL, thetaLR, corpus, thetaB, thetaLX)


# ---------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------


# The targets: T (the hard case, VOS), T′ (code "R", S relexified: the positive control)
# and T′x (code "X", T′'s grammar with word forms only the extended language base's
# tokenizer has), each with its own language base.
TARGETS = {"T": "thetaL", "R": "thetaLR", "X": "thetaLX"}
# The targets that get both abilities (T′x is the vocabulary comparison, ability A only).
TWO_ABILITY_TARGETS = ("T", "R")


@dataclass(frozen=True)
class EvalFiles:
    """Per target, split and family of eval sets, the eval specs (files written once per
    seed). Families: ``A`` and ``B`` (one ability's target accuracy, perplexity, and on
    the test split its S accuracy), ``AB`` (both abilities and the pooled objective set),
    ``single`` (every set, for the single checkpoints)."""

    specs: dict[tuple[str, str, str], EvalSpec]

    def get(self, target: str, split: str, family: str = "single") -> EvalSpec:
        return self.specs[(target, split, family)]


def eval_files(cfg: Config, seed: int, data: SeedData) -> EvalFiles:
    """Write the seed's eval sets and build the specs: per ability, target accuracy and
    S accuracy on the same items (the retained ability); target perplexity (language
    kept); for a merge of both abilities, both abilities' items pooled (the objective)."""
    root = CACHE / "evalsets" / cfg.name / f"seed{seed}"
    specs: dict[tuple[str, str, str], EvalSpec] = {}
    for split in ("val", "test"):
        problems = data.problems.val if split == "val" else data.problems.test
        comps = data.comparisons.val if split == "val" else data.comparisons.test

        def acc(name: str, language: str, stem: str, items: Sequence[lang.Item],
                split: str = split) -> EvalSetSpec:
            return E.accuracy_set(name, language, E.problems_file(
                root / f"{split}-{language}-{stem}.jsonl", [p.prompt(language) for p in items],
                [p.answer for p in items]))

        src = acc("S_acc", "S", "problems", problems)
        src_b = acc("S_acc_b", "S", "comparisons", comps)
        for target in TARGETS:
            tacc = acc("target_acc", target, "problems", problems)
            docs = data.docs[target][0 if split == "val" else 1]
            ppl = E.perplexity_set("target_ppl", target,
                                   E.docs_file(root / f"{split}-{target}-docs.jsonl", docs))
            test = split == "test"
            specs[(target, split, "A")] = E.spec(tacc, ppl, *([src] if test else []))
            if target not in TWO_ABILITY_TARGETS:
                specs[(target, split, "single")] = E.spec(tacc, ppl, src)
                continue
            tacc_b = acc("target_acc_b", target, "comparisons", comps)
            # Equal halves (n_val or n_test items of each), so the pooled accuracy is the
            # mean of the two abilities' accuracies.
            pooled = acc("target_acc_ab", target, "pooled", [*problems, *comps])
            specs[(target, split, "B")] = E.spec(tacc_b, ppl, *([src_b] if test else []))
            # On validation the pooled set (the sweep's objective) and perplexity (its
            # constraint) only: the pooled items are both abilities' items, so scoring
            # each ability's set as well would generate every answer twice.
            specs[(target, split, "AB")] = E.spec(pooled, *([tacc, tacc_b] if test else []),
                                                  ppl, *([src, src_b] if test else []))
            specs[(target, split, "single")] = E.spec(tacc, tacc_b, pooled, ppl, src, src_b)
    return EvalFiles(specs)


def scores(report: EvalReport) -> dict[str, dict[str, float]]:
    """{model label: {set name: value}} from the library's report."""
    return {m.label: {s.name: s.value for s in m.sets} for m in report.models}


def evaluate_folders(folders: dict[str, Path], spec: EvalSpec) -> dict[str, dict[str, float]]:
    from maec_core.eval.runner import evaluate_many

    return scores(
        evaluate_many({k: str(v) for k, v in folders.items()}, spec, RunContext(device="cpu"))
    )


def evaluate_folder(folder: Path, spec: EvalSpec) -> dict[str, float]:
    return evaluate_folders({"model": folder}, spec)["model"]


@dataclass
class MethodResult:
    """A single checkpoint's or a method's scores. For a method: the winner on the
    objective alone (``knobs``, ``val``, ``test``: the setting the first experiment's
    tables report) and the winner under the fluency constraint (``constrained``: its
    knobs, validation and test scores; None when no candidate met the constraint)."""

    knobs: dict[str, Any]
    val: dict[str, float]
    test: dict[str, float]
    sweep: list[dict[str, Any]] = field(default_factory=list)
    report: dict[str, Any] | None = None
    # The sweep library's account of the choice, and how many ability vectors it extracted.
    why: str = ""
    extractions: int | None = 0
    sweep_dir: str | None = None
    # "single" (a checkpoint), or the family of eval sets the sweep was scored on: "A",
    # "B" (one ability) or "AB" (both).
    family: str = "single"
    constrained: dict[str, Any] | None = None
    constrained_why: str = ""
    # The constraint's bound on validation target perplexity (PPL_RATIO x the language
    # base's) and how many candidates met it.
    bound: float | None = None
    feasible: int | None = None


def run_seed(cfg: Config, seed: int) -> dict[str, Any]:
    """One seed's results, cached as JSON under the keys of everything that made them."""
    key = cfg.result_key(seed)
    path = CACHE / "results" / f"{key}.json"
    if path.exists():
        log(f"seed {seed}: results cached ({path.name})")
        cached: dict[str, Any] = json.loads(path.read_text())
        return cached
    out = _run_seed(cfg, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(path)
    return out


def _run_seed(cfg: Config, seed: int) -> dict[str, Any]:
    started = time.perf_counter()
    log(f"seed {seed}: data")
    data = seed_data(cfg, seed)
    ck = checkpoints(cfg, seed, data)
    files = eval_files(cfg, seed, data)
    out: dict[str, Any] = {"seed": seed, "targets": {}}
    theta0 = M.load(ck.theta0)
    out["alignment_theta0"] = M.hidden_alignment(theta0, data.align_pairs)
    out["alignment_theta0_R"] = M.hidden_alignment(theta0, data.align_pairs_r)
    out["alignment_words_theta0"] = word_alignment(theta0, "T")
    out["alignment_words_theta0_R"] = word_alignment(theta0, "R")
    out["delta_norm"] = {name: relative_delta(theta0, M.load(getattr(ck, name)))
                         for name in ("thetaA", "thetaS", "thetaL", "thetaLR", "thetaB",
                                      "thetaLX")}
    for target in TARGETS:
        out["targets"][target] = run_target(cfg, seed, ck, files, target)
    # This seed's wall time, training of its cached checkpoints included when it ran here.
    out["seconds"] = time.perf_counter() - started
    return out


def run_target(cfg: Config, seed: int, ck: Checkpoints, files: EvalFiles,
               target: str) -> dict[str, Any]:
    """Single checkpoints and every method's sweep for one target language. The language
    base is θL for T, θL′ for T′ and θL′x for T′x; in every table it is ``thetaL``."""
    language = getattr(ck, TARGETS[target])
    singles = {"theta0": ck.theta0, "thetaL": language, "thetaA": ck.thetaA}
    if target in TWO_ABILITY_TARGETS:
        singles.update(thetaS=ck.thetaS, thetaB=ck.thetaB)
    val = evaluate_folders(singles, files.get(target, "val"))
    test = evaluate_folders(singles, files.get(target, "test"))
    methods: dict[str, Any] = {k: asdict(MethodResult({}, val[k], test[k])) for k in singles}
    log(f"seed {seed} {target}: singles " + ", ".join(
        f"{k} {target}={v['test']['target_acc']:.3f} S={v['test']['S_acc']:.3f}"
        + (f" B: {target}={v['test']['target_acc_b']:.3f} S={v['test']['S_acc_b']:.3f}"
           if "target_acc_b" in v["test"] else "")
        for k, v in methods.items()))
    work = CACHE / "merges" / cfg.name / f"seed{seed}" / target
    val_specs = {f: files.get(target, "val", f) for f in ("A", "B", "AB")
                 if (target, "val", f) in files.specs}
    recipes = (sweep_recipes(cfg, ck, seed, language, val_specs)
               if target in TWO_ABILITY_TARGETS else
               extvocab_recipes(cfg, ck, seed, val_specs["A"]))
    for method, swept in recipes.items():
        methods[method] = run_method(cfg, seed, target, method, swept, work,
                                     files.get(target, "test", swept.family))
    return {"seed": seed, "target": target, "methods": methods}


def run_method(cfg: Config, seed: int, target: str, method: str, swept: Swept,
               work: Path, test_spec: EvalSpec) -> dict[str, Any]:
    """One method's sweep on the validation split (with the fluency constraint), then
    its winners, on the objective alone and under the constraint, on the test split.

    The sweep's leaderboard and ``sweep.png`` are kept under the results' sweep folder
    (when a candidate met the constraint, so that the sweep published one); the merged
    folders themselves are removed once scored."""
    outcome = sweep(swept.recipe, work / method, MAEC_CACHE)
    by_id = {r["id"]: r for r in outcome.rows}
    chosen = {outcome.winner}
    if outcome.constrained is not None:
        chosen.add(outcome.constrained)
    tested = evaluate_folders({cid: outcome.folders[cid] for cid in sorted(chosen)},
                              test_spec)
    result = tested[outcome.winner]
    kept: Path | None = None
    if outcome.published is not None:
        kept = CACHE / "sweeps" / cfg.name / f"seed{seed}-{target}-{method}"
        kept.mkdir(parents=True, exist_ok=True)
        for name in ("leaderboard.json", "sweep.png"):
            shutil.copyfile(outcome.published / name, kept / name)
    maec_report = outcome.folders[outcome.winner] / "maec_report.json"
    report = json.loads(maec_report.read_text()) if maec_report.exists() else None
    discard(outcome)
    winner = by_id[outcome.winner]
    objective = OBJECTIVE_SET[swept.family]
    constrained = None
    if outcome.constrained is not None:
        c = by_id[outcome.constrained]
        constrained = {"knobs": c["knobs"], "val": c["val"],
                       "test": tested[outcome.constrained]}
    n_feasible = sum(1 for r in outcome.rows if r["feasible"])
    log(f"seed {seed} {target}: {method} chose {winner['knobs']} "
        f"({len(outcome.rows)} candidates, {outcome.extractions} extraction(s), "
        f"{outcome.seconds:.0f}s): val={winner['val'][objective]:.3f} "
        f"test={result[objective]:.3f} ppl={result['target_ppl']:.2f}; under the "
        f"constraint (ppl <= {outcome.bound:.2f}, {n_feasible} feasible): "
        + (f"{constrained['knobs']} test={constrained['test'][objective]:.3f} "
           f"ppl={constrained['test']['target_ppl']:.2f}" if constrained else "none"))
    return asdict(MethodResult(
        winner["knobs"], winner["val"], result, sweep=outcome.rows,
        report=summarise_report(report), why=outcome.why,
        extractions=outcome.extractions, sweep_dir=str(kept) if kept else None,
        family=swept.family, constrained=constrained,
        constrained_why=outcome.constrained_why, bound=outcome.bound,
        feasible=n_feasible))


def summarise_report(report: dict[str, Any] | None) -> dict[str, Any] | None:
    """Keep what explains a MAEC merge: how many tensors were selected, and the cosines."""
    if not report:
        return None
    keep = {}
    for k, v in report.items():
        if isinstance(v, (int, float, str, bool)) or k in ("abilities", "tensors", "totals"):
            keep[k] = v
    return keep


@torch.no_grad()
def relative_delta(base: LlamaForCausalLM, model: LlamaForCausalLM) -> float:
    """||θ − θ0|| / ||θ0|| over the transformer layers (where the merges act)."""
    num = den = 0.0
    b = dict(base.named_parameters())
    for name, p in model.named_parameters():
        if ".layers." in name:
            num += float((p - b[name]).norm() ** 2)
            den += float(b[name].norm() ** 2)
    return (num / den) ** 0.5 if den else 0.0


@torch.no_grad()
def word_alignment(model: LlamaForCausalLM, other: str) -> dict[str, float]:
    """Input-embedding cosine of each concept's S word and its word in ``other``, against
    pairs of different concepts: whether the base's lexicon itself is aligned."""
    emb = model.model.embed_tokens.weight
    s = torch.stack([emb[M.VOCAB.ids[lang.word(c, "S")]] for c in lang.LEXICON])
    t = torch.stack([emb[M.VOCAB.ids[lang.word(c, other)]] for c in lang.LEXICON])
    same = torch.nn.functional.cosine_similarity(s, t).mean()
    mismatched = torch.nn.functional.cosine_similarity(s, t.roll(1, dims=0)).mean()
    return {"same_concept": float(same), "other_concept": float(mismatched)}


# ---------------------------------------------------------------------------------------
# aggregation and report
# ---------------------------------------------------------------------------------------

ORDER = ("theta0", "thetaL", "thetaA", "thetaS", "task_arithmetic", "ties", "dare_ties",
         "layer_swap", "maec_delta", "maec_delta_ctrl", "maec_gradient",
         "maec_gradient_ctrl")


def aggregate(seeds: list[dict[str, Any]]) -> dict[str, dict[str, tuple[float, float]]]:
    table: dict[str, dict[str, tuple[float, float]]] = {}
    for method in ORDER:
        if method not in seeds[0]["methods"]:
            continue
        row = {}
        for metric in ("target_acc", "S_acc", "target_ppl"):
            xs = [s["methods"][method]["test"][metric] for s in seeds]
            row[metric] = (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0)
        table[method] = row
    return table


TARGET_NAME = {"T": "T", "R": "T′", "X": "T′x"}
# File names of the per-method sweep plots: T keeps plain names, T′ and T′x get a prefix.
FILE_PREFIX = {"T": "", "R": "control_", "X": "extvocab_"}


def markdown_table(table: dict[str, dict[str, tuple[float, float]]], chance: tuple[float, float],
                   seeds: list[dict[str, Any]]) -> str:
    t = TARGET_NAME[seeds[0]["target"]]
    lines = [
        f"| model / method | {t} accuracy (goal) | S accuracy (retained) | {t} perplexity | "
        "chosen on validation (seed " + str(seeds[0]["seed"]) + ") |",
        "|---|---|---|---|---|",
    ]
    for method, row in table.items():
        knobs = seeds[0]["methods"][method]["knobs"]
        lines.append(
            f"| {method} | {row['target_acc'][0]:.3f} ± {row['target_acc'][1]:.3f} | "
            f"{row['S_acc'][0]:.3f} ± {row['S_acc'][1]:.3f} | "
            f"{row['target_ppl'][0]:.2f} ± {row['target_ppl'][1]:.2f} | "
            f"{', '.join(f'{k}={v}' for k, v in knobs.items()) or '—'} |")
    lines.append(f"| chance (uniform over 0–{lang.MAX_NUM} / most frequent answer) | "
                 f"{chance[0]:.3f} / {chance[1]:.3f} | {chance[0]:.3f} / {chance[1]:.3f} | "
                 "— | — |")
    return "\n".join(lines)


def diagnostics(seeds: list[dict[str, Any]]) -> str:
    """Alignment of θ0 and the size of each fine-tuning delta, per seed."""
    lines = ["| seed | θ0 hidden cosine, parallel / mismatched S-T sentences, per layer "
             "(0 = embeddings) | centred parallel | S-T word embedding cosine, same / other "
             "concept | S-T′ word cosine, same / other | S-T′ hidden cosine, parallel / "
             "mismatched, per layer | ‖θ−θ0‖/‖θ0‖ on the layers: θA, θS, θL, θL′, θB, "
             "θL′x |",
             "|---|---|---|---|---|---|---|"]
    for s in seeds:
        a = s["alignment_theta0"]
        w = s["alignment_words_theta0"]
        wr = s["alignment_words_theta0_R"]
        ar = s["alignment_theta0_R"]
        d = s["delta_norm"]
        pairs_r = ", ".join(f"{p:.2f}/{m:.2f}" for p, m in zip(ar["parallel"],
                                                               ar["mismatched"], strict=True))
        pairs = ", ".join(f"{p:.2f}/{m:.2f}" for p, m in zip(a["parallel"], a["mismatched"],
                                                             strict=True))
        lines.append(f"| {s['seed']} | {pairs} | "
                     f"{', '.join(f'{c:.2f}' for c in a['centred_parallel'])} | "
                     f"{w['same_concept']:.2f} / {w['other_concept']:.2f} | "
                     f"{wr['same_concept']:.2f} / {wr['other_concept']:.2f} | {pairs_r} | "
                     f"{d['thetaA']:.3f}, {d['thetaS']:.3f}, {d['thetaL']:.3f}, "
                     f"{d['thetaLR']:.3f}, {d['thetaB']:.3f}, {d['thetaLX']:.3f} |")
    return "\n".join(lines)


# The methods run with one ability and with both, and the baselines the constrained
# comparison sets against MAEC (every non-MAEC method of ability A).
MULTI_METHODS = ("task_arithmetic", "ties", "dare_ties", "maec_delta")
BASELINES = ("task_arithmetic", "ties", "dare_ties", "layer_swap")


def _stat(xs: Sequence[float]) -> str:
    """mean ± standard deviation over seeds."""
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.fmean(xs):.3f} ± {sd:.3f}"


def family_score(scores: dict[str, float], family: str) -> float:
    """What a merge is judged by: its ability's target accuracy, or for a merge of both
    abilities the lower of the two."""
    if family == "AB":
        return min(scores["target_acc"], scores["target_acc_b"])
    return scores["target_acc_b" if family == "B" else "target_acc"]


def two_ability_table(seeds: list[dict[str, Any]], chance_b: tuple[float, float, float]
                      ) -> str:
    """Each ability's test accuracy in the target alone (one donor merged) and together
    (both donors in one merge), and the drop: the interference."""
    t = TARGET_NAME[seeds[0]["target"]]
    lines = [f"| model / method | A: {t} acc, one ability | A: both | A: drop | "
             f"B: {t} acc, one ability | B: both | B: drop | min(A, B), both | "
             f"{t} perplexity, both | S acc A / B, both | chosen on validation, both "
             f"(seed {seeds[0]['seed']}) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in ("thetaL", "thetaA", "thetaB"):
        tests = [s["methods"][name]["test"] for s in seeds]
        a = [x["target_acc"] for x in tests]
        b = [x["target_acc_b"] for x in tests]
        lines.append(f"| {name} | {_stat(a)} | — | — | {_stat(b)} | — | — | "
                     f"{_stat([min(x, y) for x, y in zip(a, b, strict=True)])} | "
                     f"{_stat([x['target_ppl'] for x in tests])} | "
                     f"{_stat([x['S_acc'] for x in tests])} / "
                     f"{_stat([x['S_acc_b'] for x in tests])} | — |")
    for m in MULTI_METHODS:
        a1 = [s["methods"][m]["test"]["target_acc"] for s in seeds]
        b1 = [s["methods"][f"{m}_b"]["test"]["target_acc_b"] for s in seeds]
        both = [s["methods"][f"{m}_multi"]["test"] for s in seeds]
        am = [x["target_acc"] for x in both]
        bm = [x["target_acc_b"] for x in both]
        knobs = seeds[0]["methods"][f"{m}_multi"]["knobs"]
        lines.append(
            f"| {m} | {_stat(a1)} | {_stat(am)} | "
            f"{_stat([x - y for x, y in zip(a1, am, strict=True)])} | {_stat(b1)} | "
            f"{_stat(bm)} | {_stat([x - y for x, y in zip(b1, bm, strict=True)])} | "
            f"{_stat([min(x, y) for x, y in zip(am, bm, strict=True)])} | "
            f"{_stat([x['target_ppl'] for x in both])} | "
            f"{_stat([x['S_acc'] for x in both])} / {_stat([x['S_acc_b'] for x in both])} | "
            f"{', '.join(f'{k}={v}' for k, v in knobs.items())} |")
    lines.append(f"| chance, B (uniform over 0–{lang.MAX_NUM} / one of the two counts shown / "
                 f"most frequent answer) | — | — | — | {chance_b[0]:.3f} / {chance_b[1]:.3f} / "
                 f"{chance_b[2]:.3f} | — | — | — | — | — | — |")
    return "\n".join(lines)


def constrained_table(seeds: list[dict[str, Any]]) -> str:
    """Every method's winner on accuracy alone beside its winner under the fluency
    constraint, both on the test split (for a merge of both abilities, the lower of its
    two accuracies)."""
    t = TARGET_NAME[seeds[0]["target"]]
    s0 = seeds[0]["methods"]
    lines = [f"| method (ability) | accuracy alone: {t} acc | {t} perplexity | "
             f"under the constraint: {t} acc | {t} perplexity | seeds with a feasible "
             f"candidate | feasible candidates (seed {seeds[0]['seed']}) | chosen under the "
             f"constraint (seed {seeds[0]['seed']}) |",
             "|---|---|---|---|---|---|---|---|"]
    for m, r0 in s0.items():
        if r0["family"] == "single":
            continue
        fam = r0["family"]
        free = [s["methods"][m]["test"] for s in seeds]
        held = [s["methods"][m]["constrained"] for s in seeds]
        ok = [c["test"] for c in held if c is not None]
        c0 = r0["constrained"]
        lines.append(
            f"| {m} ({fam}) | {_stat([family_score(x, fam) for x in free])} | "
            f"{_stat([x['target_ppl'] for x in free])} | "
            + (f"{_stat([family_score(x, fam) for x in ok])} | "
               f"{_stat([x['target_ppl'] for x in ok])} | " if ok else "none | — | ")
            + f"{len(ok)}/{len(seeds)} | {r0['feasible']}/{len(r0['sweep'])} | "
            + (", ".join(f"{k}={v}" for k, v in c0["knobs"].items()) if c0 else "none")
            + " |")
    bounds = [s["methods"]["task_arithmetic"]["bound"] for s in seeds]
    lines.append(f"\nThe bound: validation {t} perplexity at most {PPL_RATIO} × the "
                 f"language base's, {', '.join(f'{b:.2f}' for b in bounds)} (per seed).")
    return "\n".join(lines)


def best_constrained_baseline(methods: dict[str, Any]) -> str | None:
    """The baseline reported beside MAEC under the constraint: the one whose constrained
    winner has the highest *validation* target accuracy (ties: BASELINES order), so that
    the test split is not used to pick it. None when no baseline met the constraint."""
    best: tuple[float, str] | None = None
    for m in BASELINES:
        c = methods[m]["constrained"]
        if c is not None and (best is None or c["val"]["target_acc"] > best[0]):
            best = (c["val"]["target_acc"], m)
    return best[1] if best else None


def _mean_or_nan(xs: Sequence[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


def new_fields(per_target: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """The RESULT line's fields for the two-ability merges, the constrained selection and
    the extended vocabulary, all on T′ (T′x for the vocabulary), means over seeds. A
    constrained field averages the seeds where a candidate met the constraint; nan when
    none did."""
    r = per_target["R"]
    x = per_target["X"]
    out: dict[str, float] = {}
    for key, m in (("multi_maec_min_acc", "maec_delta_multi"),
                   ("multi_ta_min_acc", "task_arithmetic_multi"),
                   ("multi_ties_min_acc", "ties_multi")):
        out[key] = statistics.fmean(family_score(s["methods"][m]["test"], "AB") for s in r)
    out["constrained_maec_acc"] = _mean_or_nan([
        c["test"]["target_acc"] for s in r
        if (c := s["methods"]["maec_delta"]["constrained"]) is not None])
    baseline = []
    for s in r:
        b = best_constrained_baseline(s["methods"])
        if b is not None:
            baseline.append(s["methods"][b]["constrained"]["test"]["target_acc"])
    out["constrained_best_baseline_acc"] = _mean_or_nan(baseline)
    out["extvocab_maec_acc"] = statistics.fmean(
        s["methods"]["maec_delta"]["test"]["target_acc"] for s in x)
    out["extvocab_ta_acc"] = statistics.fmean(
        s["methods"]["task_arithmetic"]["test"]["target_acc"] for s in x)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--full", action="store_true")
    mode.add_argument("--smoke", action="store_true")
    mode.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seeds", type=int, nargs="*", default=None,
                    help="only fill the cache for these seeds (for parallel runs), no report")
    ap.add_argument("--base-only", action="store_true",
                    help="only train θ0 (shared by every seed), then stop")
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (default experiments/transfer/results/<name>)")
    ap.add_argument("--plots", type=Path, default=None,
                    help="where PNGs go (default docs/experiments for --full, none for smoke)")
    args = ap.parse_args(argv)
    cfg = FULL if args.full else SMOKE if args.smoke else DEBUG
    from transformers.utils import logging as hf_logging

    # Hundreds of model loads: one progress bar each would drown the log.
    hf_logging.disable_progress_bar()
    with torch_threads(args.threads or cfg.threads):
        return _main(args, cfg)


def _main(args: argparse.Namespace, cfg: Config) -> int:
    started = time.perf_counter()
    if args.base_only:
        checkpoints_base(cfg, cfg.seeds[0])
        return 0
    if args.seeds is not None:
        for s in args.seeds:
            run_seed(cfg, s)
        return 0
    seeds = [run_seed(cfg, s) for s in cfg.seeds]
    elapsed = time.perf_counter() - started
    data0 = seed_data(cfg, cfg.seeds[0])
    # Every target renders the same items, so one chance level per ability serves all.
    chance = lang.chance_levels(data0.problems.test)
    # Ability B: a uniform guess, one of the two (different) counts shown, the majority.
    chance_b = (1.0 / (lang.MAX_NUM + 1), 0.5, lang.chance_levels(data0.comparisons.test)[1])
    per_target = {t: [s["targets"][t] for s in seeds] for t in TARGETS}
    tables = {t: aggregate(rows) for t, rows in per_target.items()}
    fields = new_fields(per_target)
    out_dir = args.out or (CACHE / "debug" if cfg is DEBUG else HERE / "results" / cfg.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(
        {"config": repr(cfg), "seconds": elapsed, "chance": chance, "chance_b": chance_b,
         "ppl_ratio": PPL_RATIO, "seeds": seeds, "tables": tables, "result_fields": fields},
        indent=1, default=str))
    md = "\n\n".join([
        f"T (VOS, the hard case)\n\n{markdown_table(tables['T'], chance, per_target['T'])}",
        f"T′ (S relexified, the positive control)\n\n"
        f"{markdown_table(tables['R'], chance, per_target['R'])}",
        f"T′x (T′ with word forms only the extended language base's tokenizer has; "
        f"task arithmetic and TIES with tokenizer_source: union, MAEC with the language "
        f"base's tokenizer)\n\n{markdown_table(tables['X'], chance, per_target['X'])}",
        f"Two abilities, T′\n\n{two_ability_table(per_target['R'], chance_b)}",
        f"Two abilities, T\n\n{two_ability_table(per_target['T'], chance_b)}",
        f"Selection under the fluency constraint, T′\n\n"
        f"{constrained_table(per_target['R'])}",
        f"Selection under the fluency constraint, T′x\n\n"
        f"{constrained_table(per_target['X'])}",
        f"Selection under the fluency constraint, T\n\n{constrained_table(per_target['T'])}",
        diagnostics(seeds)])
    (out_dir / "table.md").write_text(md + "\n")
    print(md)
    plots = args.plots if args.plots is not None else (
        ROOT / "docs" / "experiments" if args.full else None)
    if plots is not None:
        from experiments.transfer.plots import make_plots

        make_plots(cfg, seeds, chance, plots)
        copy_sweep_plots(seeds[0], plots / "sweeps")
    log(f"done in {elapsed:.0f}s")
    print(result_line(tables, fields), flush=True)
    return 0


def copy_sweep_plots(seed: dict[str, Any], out: Path) -> None:
    """The sweep library's own plot of every method's sweep (one seed), as published
    beside a sweep job's winner."""
    out.mkdir(parents=True, exist_ok=True)
    for target, rows in seed["targets"].items():
        for method, res in rows["methods"].items():
            # A sweep where no candidate met the constraint published nothing, no plot.
            if res.get("sweep_dir"):
                shutil.copyfile(Path(res["sweep_dir"]) / "sweep.png",
                                out / f"{FILE_PREFIX[target]}{method}.png")


def result_line(tables: dict[str, dict[str, dict[str, tuple[float, float]]]],
                fields: dict[str, float]) -> str:
    t, r = tables["T"], tables["R"]

    def acc(table: dict[str, dict[str, tuple[float, float]]], method: str) -> str:
        return f"{table[method]['target_acc'][0]:.3f}"

    return (f"RESULT transfer maec_target_acc={acc(t, best_maec(t))} "
            f"langbase_target_acc={acc(t, 'thetaL')} "
            f"ta_target_acc={acc(t, 'task_arithmetic')} "
            f"layerswap_target_acc={acc(t, 'layer_swap')} "
            f"control_donor_target_acc={acc(r, 'thetaA')} "
            f"control_maec_target_acc={acc(r, best_maec(r))} "
            f"control_langbase_target_acc={acc(r, 'thetaL')} "
            + " ".join(f"{k}={v:.3f}" for k, v in fields.items()))


def best_maec(table: dict[str, dict[str, tuple[float, float]]]) -> str:
    """The MAEC variant reported on the RESULT line: the plain default (delta importance,
    no control) when present, so the line does not itself pick a winner on test data."""
    return "maec_delta" if "maec_delta" in table else next(
        k for k in table if k.startswith("maec"))


if __name__ == "__main__":
    sys.exit(main())
