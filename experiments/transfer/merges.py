"""Recipes for every compared method, all executed by the project's engine (maec_core)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.transfer.config import Config


@dataclass(frozen=True)
class Checkpoints:
    theta0: Path
    thetaA: Path
    thetaS: Path
    thetaL: Path
    thetaLR: Path  # θL′: θ0 + T′ text, the positive control's language base
    corpus: Path  # S ability text (JSONL) for importance: gradient


@dataclass(frozen=True)
class Candidate:
    """One point of one method's sweep: a recipe plus the knob values it stands for."""

    method: str
    knobs: dict[str, Any]
    recipe: dict[str, Any]


def _model(path: Path, **params: Any) -> dict[str, Any]:
    return {"model": str(path), "parameters": params}


def candidates(cfg: Config, ck: Checkpoints, seed: int, language: Path) -> list[Candidate]:
    """Every method's sweep with ``language`` (θL for T, θL′ for T′) as the language side."""
    sw = cfg.sweep
    out: list[Candidate] = []
    for w in sw.ta_weight:
        out.append(Candidate("task_arithmetic", {"ability_weight": w}, {
            "merge_method": "task_arithmetic", "base_model": str(ck.theta0),
            "models": [_model(ck.thetaA, weight=w), _model(language, weight=1.0)],
            "dtype": "float32"}))
    for method in ("ties", "dare_ties"):
        for d in sw.ties_density:
            for w in sw.ties_weight:
                params: dict[str, Any] = {}
                if method == "dare_ties":
                    params["random_seed"] = seed
                out.append(Candidate(method, {"density": d, "ability_weight": w}, {
                    "merge_method": method, "base_model": str(ck.theta0),
                    "models": [_model(ck.thetaA, weight=w, density=d),
                               _model(language, weight=1.0, density=d)],
                    "parameters": params, "dtype": "float32"}))
    for bottom, top in sw.swap:
        out.append(Candidate("layer_swap", {"bottom_k": bottom, "top_k": top}, {
            "merge_method": "layer_swap",
            "models": [_model(ck.thetaA, role="ability"), _model(language, role="language")],
            "parameters": {"bottom_k": bottom, "top_k": top, "transition": 0},
            "dtype": "float32"}))
    for vi, (importance, control) in enumerate(sw.maec_variants):
        method = maec_name(importance, control)
        mus = sw.mu if vi == 0 else sw.coarse_mu
        ratios = sw.selection_ratio if vi == 0 else sw.coarse_selection_ratio
        for kr in sw.key_ratio:
            for mu in mus:
                for sr in ratios:
                    ability: dict[str, Any] = {"model": str(ck.thetaA), "mu": mu}
                    if control:
                        ability["control"] = str(ck.thetaS)
                    params = {"importance": importance, "granularity": "row",
                              "key_ratio": kr, "rank_scope": "tensor", "selection": "ratio",
                              "selection_ratio": sr, "artifact_dtype": "float32"}
                    if importance == "gradient":
                        ability["corpus"] = str(ck.corpus)
                        # The tiny model's context is cfg.seq_len tokens, not 512.
                        params.update(token_budget=cfg.gradient_tokens, batch_size=16,
                                      seq_len=cfg.seq_len)
                    out.append(Candidate(method, {"key_ratio": kr, "mu": mu,
                                                  "selection_ratio": sr}, {
                        "merge_method": "maec", "base_model": str(ck.theta0),
                        "language_base": str(language), "abilities": [ability],
                        "parameters": params, "dtype": "float32"}))
    return out


def maec_name(importance: str, control: bool) -> str:
    return f"maec_{importance}" + ("_ctrl" if control else "")


def merge(recipe: dict[str, Any], out_dir: Path, cache: Path) -> dict[str, Any] | None:
    """Run one recipe through ``maec_core.run``; returns the MAEC report (or None).

    ``cache`` keeps input digests and extracted ability artifacts, so a sweep extracts
    each donor once and every other candidate only combines.
    """
    from maec_core.maec.store import LocalArtifactStore
    from maec_core.recipe import parse_recipe
    from maec_core.run import run

    if out_dir.exists():
        shutil.rmtree(out_dir)
    result = run(parse_recipe(recipe), out_dir, device="cpu",
                 artifact_store=LocalArtifactStore(cache / "artifacts"),
                 hash_cache=cache / "sha256")
    return result.report
