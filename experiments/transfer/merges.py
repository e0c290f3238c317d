"""Every compared method as one sweep recipe, run by the project's sweep library.

Each method's grid is a ``sweep:`` block on an ordinary recipe, scored on the validation
split's eval sets and run by :func:`maec_core.sweep.runner.run_sweep`, the same code a
sweep job runs: each MAEC extraction once per key_ratio (its candidates of other ``mu``
and ``selection_ratio`` only combine), one candidate model in memory at a time, the
winner published with its leaderboard and ``sweep.png``.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.transfer.config import Config
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


# What a sweep maximises: target-language accuracy on the validation split (ties keep
# grid order, the library's rule).
OBJECTIVE = {"set": "target_acc", "metric": "accuracy"}


def _model(path: Path, **params: Any) -> dict[str, Any]:
    return {"model": str(path), "parameters": params}


def _swept(recipe: dict[str, Any], grid: dict[str, list[float]], val: EvalSpec
           ) -> dict[str, Any]:
    return {**recipe, "dtype": "float32",
            "evaluate": [s.model_dump(exclude_none=True) for s in val.sets],
            "sweep": {"grid": grid, "objective": OBJECTIVE, "publish": "best"}}


def sweep_recipes(cfg: Config, ck: Checkpoints, seed: int, language: Path, val: EvalSpec
                  ) -> dict[str, dict[str, Any]]:
    """Every method's sweep recipe with ``language`` (θL for T, θL′ for T′) as the
    language side, scored on ``val``."""
    sw = cfg.sweep
    out: dict[str, dict[str, Any]] = {}
    out["task_arithmetic"] = _swept({
        "merge_method": "task_arithmetic", "base_model": str(ck.theta0),
        "models": [_model(ck.thetaA, weight=1.0), _model(language, weight=1.0)]},
        {"models[0].weight": list(sw.ta_weight)}, val)
    for method in ("ties", "dare_ties"):
        params: dict[str, Any] = {"random_seed": seed} if method == "dare_ties" else {}
        out[method] = _swept({
            "merge_method": method, "base_model": str(ck.theta0),
            "models": [_model(ck.thetaA, weight=1.0, density=0.5),
                       _model(language, weight=1.0, density=0.5)],
            "parameters": params},
            {"density": list(sw.ties_density), "models[0].weight": list(sw.ties_weight)}, val)
    out["layer_swap"] = _swept({
        "merge_method": "layer_swap",
        "models": [_model(ck.thetaA, role="ability"), _model(language, role="language")],
        "parameters": {"bottom_k": 1, "top_k": 1, "transition": 0}},
        {"bottom_k": list(sw.swap_bottom), "top_k": list(sw.swap_top)}, val)
    for vi, (importance, control) in enumerate(sw.maec_variants):
        ability: dict[str, Any] = {"model": str(ck.thetaA), "mu": 1.0}
        if control:
            ability["control"] = str(ck.thetaS)
        params = {"importance": importance, "granularity": "row", "key_ratio": 0.1,
                  "rank_scope": "tensor", "selection": "ratio", "selection_ratio": 1.0,
                  "artifact_dtype": "float32"}
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
                                     else sw.coarse_selection_ratio)}, val)
    return out


def maec_name(importance: str, control: bool) -> str:
    return f"maec_{importance}" + ("_ctrl" if control else "")


@dataclass
class SweepOutcome:
    """One method's sweep: the winner's folder, the leaderboard, the extraction count."""

    folder: Path
    board: dict[str, Any]
    extractions: int
    seconds: float


def sweep(recipe: dict[str, Any], out_dir: Path, cache: Path) -> SweepOutcome:
    """Run one sweep recipe through ``maec_core.sweep.runner.run_sweep`` into ``out_dir``.

    ``cache`` keeps input digests and extracted ability artifacts across sweeps and runs,
    so a rerun reuses every extraction and only combines.
    """
    from maec_core.maec.store import LocalArtifactStore
    from maec_core.parsing import parse_recipe
    from maec_core.sweep.runner import run_sweep

    if out_dir.exists():
        shutil.rmtree(out_dir)
    result = run_sweep(
        parse_recipe(recipe),
        out_dir,
        RunContext(
            device="cpu",
            artifact_store=LocalArtifactStore(cache / "artifacts"),
            hash_cache=cache / "sha256",
        ),
    )
    return SweepOutcome(out_dir, result.board.model_dump(mode="json"), result.extractions,
                        result.seconds)
