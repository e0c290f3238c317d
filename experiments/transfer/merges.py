"""Every compared method as one sweep recipe, run by the project's sweep library.

Each method's grid is a ``sweep:`` block on an ordinary recipe, scored on the validation
split's eval sets and run by :func:`maec_core.sweep.runner.run_sweep`, the same code a
sweep job runs: each MAEC extraction once per key_ratio (its candidates of other ``mu``
and ``selection_ratio`` only combine), one candidate model in memory at a time, the
winner published with its leaderboard and ``sweep.png``.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.transfer.config import PPL_RATIO, Config
from maec_core.context import RunContext
from maec_core.eval import EvalSpec


@dataclass(frozen=True)
class Checkpoints:
    theta0: Path
    thetaA: Path
    thetaS: Path
    thetaL: Path
    thetaLR: Path  # θL′: θ0 + T′ text, the positive control's language base
    corpus: Path  # S ability text (JSONL) for importance: gradient
    thetaB: Path  # the second ability's donor (comparisons in S)
    thetaLX: Path  # θL′x: θ0 with T′x's tokens appended, + T′x text


# What each family of sweeps maximises on the validation split (ties keep grid order,
# the library's rule): ability A's target accuracy, ability B's, or, for a merge of both,
# the accuracy on both abilities' items pooled in one set of equal halves, i.e. the mean
# of the two. The library's objective is one set's metric: the worse of the two
# abilities cannot be asked for, and selecting on A alone would ignore B.
OBJECTIVE_SET = {"A": "target_acc", "B": "target_acc_b", "AB": "target_acc_ab"}
# Every sweep carries the fluency constraint; the unconstrained winner is ranked from the
# same rows without it (run.py).
CONSTRAINT = {"set": "target_ppl", "metric": "perplexity", "max_ratio_to": "language_base",
              "value": PPL_RATIO}


@dataclass(frozen=True)
class Swept:
    """One method's sweep recipe and the family of eval sets it is scored on."""

    recipe: dict[str, Any]
    family: str  # "A", "B" or "AB"


def _model(path: Path, **params: Any) -> dict[str, Any]:
    return {"model": str(path), "parameters": params}


def _swept(recipe: dict[str, Any], grid: dict[str, list[float]], val: EvalSpec,
           family: str = "A") -> Swept:
    # publish: all, so that every candidate is written and can be kept: the constrained
    # and the unconstrained winner are both scored on the test split.
    return Swept({**recipe, "dtype": "float32",
                  "evaluate": [s.model_dump(exclude_none=True) for s in val.sets],
                  "sweep": {"grid": grid,
                            "objective": {"set": OBJECTIVE_SET[family],
                                          "metric": "accuracy"},
                            "constraint": CONSTRAINT, "publish": "all"}}, family)


def _maec_params(**over: Any) -> dict[str, Any]:
    return {"importance": "delta", "granularity": "row", "key_ratio": 0.1,
            "rank_scope": "tensor", "selection": "ratio", "selection_ratio": 1.0,
            "artifact_dtype": "float32", **over}


def sweep_recipes(cfg: Config, ck: Checkpoints, seed: int, language: Path,
                  val: dict[str, EvalSpec]) -> dict[str, Swept]:
    """Every method's sweep recipe with ``language`` (θL for T, θL′ for T′) as the
    language side; ``val`` holds the validation eval spec of each family. Ability A's
    methods (the first experiment's), ability B's alone (``*_b``, the reference for
    interference) and both abilities in one merge (``*_multi``)."""
    sw = cfg.sweep
    out: dict[str, Swept] = {}
    out["task_arithmetic"] = _swept({
        "merge_method": "task_arithmetic", "base_model": str(ck.theta0),
        "models": [_model(ck.thetaA, weight=1.0), _model(language, weight=1.0)]},
        {"models[0].weight": list(sw.ta_weight)}, val["A"])
    for method in ("ties", "dare_ties"):
        params: dict[str, Any] = {"random_seed": seed} if method == "dare_ties" else {}
        out[method] = _swept({
            "merge_method": method, "base_model": str(ck.theta0),
            "models": [_model(ck.thetaA, weight=1.0, density=0.5),
                       _model(language, weight=1.0, density=0.5)],
            "parameters": params},
            {"density": list(sw.ties_density), "models[0].weight": list(sw.ties_weight)},
            val["A"])
    out["layer_swap"] = _swept({
        "merge_method": "layer_swap",
        "models": [_model(ck.thetaA, role="ability"), _model(language, role="language")],
        "parameters": {"bottom_k": 1, "top_k": 1, "transition": 0}},
        {"bottom_k": list(sw.swap_bottom), "top_k": list(sw.swap_top)}, val["A"])
    for vi, (importance, control) in enumerate(sw.maec_variants):
        ability: dict[str, Any] = {"model": str(ck.thetaA), "mu": 1.0}
        if control:
            ability["control"] = str(ck.thetaS)
        params = _maec_params(importance=importance)
        if importance == "gradient":
            ability["corpus"] = str(ck.corpus)
            # The tiny model's context is cfg.seq_len tokens, not 512.
            params.update(token_budget=cfg.gradient_tokens, batch_size=16,
                          seq_len=cfg.seq_len)
        # The first variant gets the full grid; the others, to fit the time budget, a
        # coarser one.
        out[maec_name(importance, control)] = _swept({
            "merge_method": "maec", "base_model": str(ck.theta0),
            "language_base": str(language), "abilities": [ability], "parameters": params},
            {"key_ratio": list(sw.key_ratio),
             "mu": list(sw.mu if vi == 0 else sw.coarse_mu),
             "selection_ratio": list(sw.selection_ratio if vi == 0
                                     else sw.coarse_selection_ratio)}, val["A"])
    out.update(_ability_b(cfg, ck, seed, language, val["B"]))
    out.update(_multi(cfg, ck, seed, language, val["AB"]))
    return out


def _ability_b(cfg: Config, ck: Checkpoints, seed: int, language: Path, val: EvalSpec
               ) -> dict[str, Swept]:
    """Ability B alone, each method on the coarse grid: the single-ability reference the
    two-ability merges' interference is measured against."""
    sw = cfg.sweep
    base = str(ck.theta0)
    return {
        "task_arithmetic_b": _swept({
            "merge_method": "task_arithmetic", "base_model": base,
            "models": [_model(ck.thetaB, weight=1.0), _model(language, weight=1.0)]},
            {"models[0].weight": list(sw.extra_ta_weight)}, val, "B"),
        **{f"{method}_b": _swept({
            "merge_method": method, "base_model": base,
            "models": [_model(ck.thetaB, weight=1.0, density=0.5),
                       _model(language, weight=1.0, density=0.5)],
            "parameters": {"random_seed": seed} if method == "dare_ties" else {}},
            {"density": list(sw.extra_density), "models[0].weight": list(sw.extra_weight)},
            val, "B") for method in ("ties", "dare_ties")},
        "maec_delta_b": _swept({
            "merge_method": "maec", "base_model": base, "language_base": str(language),
            "abilities": [{"model": str(ck.thetaB), "mu": 1.0}],
            "parameters": _maec_params()},
            {"key_ratio": list(sw.extra_key_ratio), "mu": list(sw.extra_mu)}, val, "B"),
    }


def _multi(cfg: Config, ck: Checkpoints, seed: int, language: Path, val: EvalSpec
           ) -> dict[str, Swept]:
    """Both abilities in one merge: MAEC with two ability vectors and a μ for each, the
    baselines with both donors (one weight each) and the language base."""
    sw = cfg.sweep
    base = str(ck.theta0)
    ta_w = list(sw.extra_ta_weight)
    w = list(sw.extra_weight)
    mu = list(sw.extra_mu)
    return {
        "task_arithmetic_multi": _swept({
            "merge_method": "task_arithmetic", "base_model": base,
            "models": [_model(ck.thetaA, weight=1.0), _model(ck.thetaB, weight=1.0),
                       _model(language, weight=1.0)]},
            {"models[0].weight": ta_w, "models[1].weight": ta_w}, val, "AB"),
        **{f"{method}_multi": _swept({
            "merge_method": method, "base_model": base,
            "models": [_model(ck.thetaA, weight=1.0, density=0.5),
                       _model(ck.thetaB, weight=1.0, density=0.5),
                       _model(language, weight=1.0, density=0.5)],
            "parameters": {"random_seed": seed} if method == "dare_ties" else {}},
            {"density": list(sw.extra_density), "models[0].weight": w,
             "models[1].weight": w}, val, "AB") for method in ("ties", "dare_ties")},
        "maec_delta_multi": _swept({
            "merge_method": "maec", "base_model": base, "language_base": str(language),
            "abilities": [{"model": str(ck.thetaA), "mu": 1.0},
                          {"model": str(ck.thetaB), "mu": 1.0}],
            "parameters": _maec_params()},
            {"key_ratio": list(sw.extra_key_ratio), "abilities[0].mu": mu,
             "abilities[1].mu": mu}, val, "AB"),
    }


def extvocab_recipes(cfg: Config, ck: Checkpoints, seed: int, val: EvalSpec
                     ) -> dict[str, Swept]:
    """Ability A into θL′x, whose tokenizer appends T′x's words to θ0's. MAEC keeps the
    language base's vocabulary (its only choice, named explicitly); task arithmetic and
    TIES take mergekit's union of the inputs' vocabularies, where the new tokens' rows
    come from the one model that has them."""
    sw = cfg.sweep
    base, lang_x = str(ck.theta0), str(ck.thetaLX)
    return {
        "task_arithmetic": _swept({
            "merge_method": "task_arithmetic", "base_model": base, "tokenizer_source": "union",
            "models": [_model(ck.thetaA, weight=1.0), _model(ck.thetaLX, weight=1.0)]},
            {"models[0].weight": list(sw.extra_ta_weight)}, val),
        "ties": _swept({
            "merge_method": "ties", "base_model": base, "tokenizer_source": "union",
            "models": [_model(ck.thetaA, weight=1.0, density=0.5),
                       _model(ck.thetaLX, weight=1.0, density=0.5)]},
            {"density": list(sw.extra_density), "models[0].weight": list(sw.extra_weight)},
            val),
        "maec_delta": _swept({
            "merge_method": "maec", "base_model": base, "language_base": lang_x,
            "tokenizer_source": lang_x,
            "abilities": [{"model": str(ck.thetaA), "mu": 1.0}],
            "parameters": _maec_params()},
            {"key_ratio": list(sw.extra_key_ratio), "mu": list(sw.extra_mu)}, val),
    }


def key_ratio_sweep(theta0: Path, donor: Path, language: Path, val: EvalSpec,
                    key_ratios: list[float], mus: list[float]) -> Swept:
    """MAEC (delta importance, no control, every tensor kept by selection) over
    ``key_ratio`` × ``mu``: the sparsity curve of one donor into one language base."""
    return _swept({
        "merge_method": "maec", "base_model": str(theta0), "language_base": str(language),
        "abilities": [{"model": str(donor), "mu": 1.0}], "parameters": _maec_params()},
        {"key_ratio": key_ratios, "mu": mus}, val)


def maec_name(importance: str, control: bool) -> str:
    return f"maec_{importance}" + ("_ctrl" if control else "")


@dataclass
class SweepOutcome:
    """One method's sweep: every candidate's validation row, the winner with the fluency
    constraint (None when no candidate met it) and without it, and the kept folders."""

    rows: list[dict[str, Any]]
    winner: str  # ranked on the objective alone (grid order breaks ties)
    why: str
    constrained: str | None  # the sweep's own winner under the constraint
    constrained_why: str
    # The language base's validation scores (the ratio constraint's reference) and the
    # bound they give.
    reference: dict[str, float]
    bound: float
    folders: dict[str, Path]  # every candidate's folder, as ``publish: all`` keeps it
    kept_dir: Path  # the folder holding them
    published: Path | None  # the sweep's output folder (absent when nothing was feasible)
    extractions: int | None  # None: nothing was published, so the sweep did not say
    seconds: float


def sweep(recipe: dict[str, Any], out_dir: Path, cache: Path) -> SweepOutcome:
    """Run one sweep recipe through ``maec_core.sweep.runner.run_sweep`` into ``out_dir``.

    The recipe carries the fluency constraint and ``publish: all``: every candidate's
    folder is kept under ``<out_dir>.candidates/<id>/`` (as a sweep job publishes it
    under ``candidates/<id>/``), the sweep's own winner is the constrained one, and the
    unconstrained winner is ranked by the library's :func:`~maec_core.sweep.board.rank`
    on the same rows with the constraint removed. When no candidate meets the constraint
    the library raises NoFeasibleCandidate after scoring them all; that is recorded, not
    raised. ``cache`` keeps input digests and extracted ability artifacts across sweeps
    and runs, so a rerun reuses every extraction and only combines.
    """
    from maec_core.artifact_store import LocalArtifactStore
    from maec_core.errors import NoFeasibleCandidate
    from maec_core.eval.report import EvalReport
    from maec_core.parsing import parse_recipe
    from maec_core.sweep.attach import EVAL_REPORT_NAME
    from maec_core.sweep.board import Row, rank
    from maec_core.sweep.grid import Candidate
    from maec_core.sweep.inputs import LANGUAGE_BASE
    from maec_core.sweep.runner import SweepOptions, run_sweep

    kept_dir = out_dir.with_name(out_dir.name + ".candidates")
    for d in (out_dir, kept_dir):
        if d.exists():
            shutil.rmtree(d)
    kept: dict[str, Path] = {}
    values: dict[str, dict[str, Any]] = {}

    def keep(cand: Candidate, folder: Path, _manifest: dict[str, Any]) -> None:
        # The sweep removes a candidate's folder once a better one is found: copy it.
        kept[cand.id] = kept_dir / cand.id
        values[cand.id] = dict(cand.values)
        shutil.copytree(folder, kept[cand.id])

    parsed = parse_recipe(recipe)
    assert parsed.sweep is not None and parsed.sweep.constraint is not None
    spec = parsed.sweep
    constraint = parsed.sweep.constraint
    t0 = time.perf_counter()
    ctx = RunContext(device="cpu", artifact_store=LocalArtifactStore(cache / "artifacts"),
                     hash_cache=cache / "sha256")
    published: Path | None = out_dir
    try:
        result = run_sweep(parsed, out_dir, ctx, SweepOptions(keep=keep))
        board = result.board
        rows = board.rows
        reference = board.reference
        constrained: str | None = board.winner
        constrained_why = board.why
        extractions: int | None = result.extractions
    except NoFeasibleCandidate as exc:
        published = None
        scores: dict[str, dict[str, float]] = exc.details["candidates"]
        rows = [Row(id=cid, values=values[cid], scores=sc, objective=sc[spec.objective.set],
                    feasible=False) for cid, sc in scores.items()]
        # Every kept candidate's eval report holds the reference the sweep scored.
        report = EvalReport.model_validate_json(
            (kept[rows[0].id] / EVAL_REPORT_NAME).read_bytes())
        reference = {s.name: s.value for m in report.models if m.label == LANGUAGE_BASE
                     for s in m.sets}
        constrained, constrained_why = None, exc.message
        extractions = None
    free = [r.model_copy(update={"feasible": True, "rank": None}) for r in rows]
    winner, why = rank(free, spec.model_copy(update={"constraint": None}), reference)
    _sense, bound = constraint.limit(reference.get(constraint.set))
    return SweepOutcome(
        rows=[{"id": r.id, "knobs": r.values, "val": r.scores, "feasible": r.feasible}
              for r in rows],
        winner=winner, why=why, constrained=constrained, constrained_why=constrained_why,
        reference=reference, bound=bound, folders=kept, kept_dir=kept_dir,
        published=published,
        extractions=extractions, seconds=time.perf_counter() - t0)


def discard(outcome: SweepOutcome) -> None:
    """Remove a sweep's folders once what is kept of it has been copied out."""
    shutil.rmtree(outcome.kept_dir, ignore_errors=True)
    if outcome.published is not None:
        shutil.rmtree(outcome.published, ignore_errors=True)
