"""Sweep and alignment plots for docs/experiments.md (matplotlib, Agg backend)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from experiments.transfer.config import PPL_RATIO, Config

KNOBS = ("key_ratio", "mu", "selection_ratio")


def _mean_best(seeds: list[dict[str, Any]], method: str, knob: str, value: float,
               metric: str) -> float:
    """Mean over seeds of the best validation value with `knob` fixed (others free)."""
    per_seed = []
    for s in seeds:
        rows = [r for r in s["methods"][method]["sweep"] if r["knobs"][knob] == value]
        per_seed.append(max(r["val"][metric] for r in rows))
    return statistics.fmean(per_seed)


def _mean_at(seeds: list[dict[str, Any]], method: str, knob: str, value: float,
             metric: str) -> float:
    """Mean over seeds of the validation value with `knob` = value and the other two knobs
    at the values chosen for that seed (a slice through the chosen point)."""
    per_seed = []
    for s in seeds:
        chosen = s["methods"][method]["knobs"]
        rows = [r for r in s["methods"][method]["sweep"]
                if r["knobs"][knob] == value
                and all(r["knobs"][k] == chosen[k] for k in KNOBS if k != knob)]
        per_seed.append(rows[0]["val"][metric])
    return statistics.fmean(per_seed)


# The targets: file-name prefix and label. T keeps the file names of the first run.
TARGETS = {"T": ("", "T"), "R": ("control_", "T′"), "X": ("extvocab_", "T′x")}
# The targets with the full set of ability-A methods (MAEC's four variants among them).
SWEPT_TARGETS = ("T", "R")


def make_plots(cfg: Config, all_seeds: list[dict[str, Any]], chance: tuple[float, float],
               out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for target, (prefix, label) in TARGETS.items():
        seeds = [s["targets"][target] for s in all_seeds]
        if target in SWEPT_TARGETS:
            written += _sweep_plots(plt, seeds, chance, out, prefix, label)
            written.append(_tradeoff(plt, seeds, chance, out / f"{prefix}tradeoff.png",
                                     label))
        written.append(_pareto(plt, seeds, chance, out / f"{prefix}pareto.png", label))
    written.append(_alignment(plt, all_seeds, out / "alignment.png"))
    return written


def _sweep_plots(plt: Any, seeds: list[dict[str, Any]], chance: tuple[float, float],
                 out: Path, prefix: str, label: str) -> list[Path]:
    written: list[Path] = []
    variants = [m for m, r in seeds[0]["methods"].items()
                if m.startswith("maec") and r["family"] == "A"]
    langbase = statistics.fmean(s["methods"]["thetaL"]["val"]["target_acc"] for s in seeds)
    donor = statistics.fmean(s["methods"]["thetaA"]["val"]["target_acc"] for s in seeds)
    for knob in KNOBS:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for v in variants:
            # Each variant's own grid (the first MAEC variant has a finer one).
            xs = sorted({r["knobs"][knob] for r in seeds[0]["methods"][v]["sweep"]})
            axes[0].plot(xs, [_mean_best(seeds, v, knob, x, "target_acc") for x in xs], "o-",
                         label=v)
            axes[1].plot(xs, [_mean_at(seeds, v, knob, x, "target_acc") for x in xs], "o-",
                         label=v)
        for ax, title in zip(axes, ("best over the other two knobs",
                                    "other knobs at the chosen setting"), strict=True):
            ax.axhline(chance[0], color="grey", ls=":", label="chance (uniform)")
            ax.axhline(langbase, color="black", ls="--", label=f"θL alone ({label} text)")
            ax.axhline(donor, color="tab:red", ls="-.", label=f"θA alone (zero-shot {label})")
            ax.set_xlabel(knob)
            ax.set_ylabel(f"validation {label} accuracy (mean over seeds)")
            ax.set_title(title, fontsize=10)
            if knob == "key_ratio":
                ax.set_xscale("log")
        axes[1].legend(fontsize=7)
        fig.suptitle(f"MAEC sweep into {label}: {knob} ({len(seeds)} seeds)")
        fig.tight_layout()
        path = out / f"{prefix}sweep_{knob}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _alignment(plt: Any, seeds: list[dict[str, Any]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for s in seeds:
        a = s["alignment_theta0"]
        layers = list(range(len(a["parallel"])))
        ax.plot(layers, s["alignment_theta0_R"]["parallel"], "^-", color="tab:purple",
                label="parallel S/T′" if s is seeds[0] else None)
        ax.plot(layers, s["alignment_theta0_R"]["mismatched"], "^--", color="tab:pink",
                label="mismatched S/T′" if s is seeds[0] else None)
        ax.plot(layers, a["parallel"], "o-", color="tab:blue",
                label="parallel S/T" if s is seeds[0] else None)
        ax.plot(layers, a["mismatched"], "o--", color="tab:orange",
                label="mismatched S/T" if s is seeds[0] else None)
        ax.plot(layers, a["centred_parallel"], "s-", color="tab:green",
                label="parallel, centred per language" if s is seeds[0] else None)
    ax.set_xlabel("layer (0 = embeddings)")
    ax.set_ylabel("cosine of mean-pooled hidden states")
    ax.set_title("θ0: do parallel sentences meet? (one line per seed)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _tradeoff(plt: Any, seeds: list[dict[str, Any]], chance: tuple[float, float], path: Path,
              label: str) -> Path:
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for method, res in seeds[0]["methods"].items():
        # Ability A's merges and checkpoints (θB is the other ability's donor).
        if res["family"] not in ("single", "A") or method == "thetaB":
            continue
        xs = [s["methods"][method]["test"]["target_ppl"] for s in seeds]
        ys = [s["methods"][method]["test"]["target_acc"] for s in seeds]
        ax.scatter(xs, ys, label=method, s=18)
    ax.axhline(chance[0], color="grey", ls=":", label="chance (uniform)")
    ax.set_xscale("log")
    ax.set_xlabel(f"{label} perplexity (test, lower = language kept)")
    ax.set_ylabel(f"{label} accuracy (test)")
    ax.set_title("every method at its chosen setting, one point per seed", fontsize=10)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _pareto(plt: Any, seeds: list[dict[str, Any]], chance: tuple[float, float], path: Path,
            label: str) -> Path:
    """Validation accuracy against validation perplexity of every candidate of every
    method (all seeds), the fluency constraint's bound and the language base marked: what
    the constrained selection chooses from. Left ability A's merges; right, where the
    target has them, the merges of both abilities (the pooled accuracy, their mean)."""
    methods = seeds[0]["methods"]
    panels = [("A", "target_acc", f"validation {label} accuracy, ability A")]
    if any(r["family"] == "AB" for r in methods.values()):
        panels.append(("AB", "target_acc_ab",
                       f"validation {label} accuracy, A and B pooled (their mean)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5.6), squeeze=False)
    bound = statistics.fmean(s["methods"]["task_arithmetic"]["bound"] for s in seeds)
    for ax, (family, metric, ylabel) in zip(axes[0], panels, strict=True):
        for method, res in methods.items():
            if res["family"] != family:
                continue
            rows = [r for s in seeds for r in s["methods"][method]["sweep"]]
            ax.scatter([r["val"]["target_ppl"] for r in rows], [r["val"][metric] for r in rows],
                       s=14, alpha=0.75, label=method)
        for name, marker, color in (("thetaL", "*", "black"), ("thetaA", "^", "tab:red"),
                                    ("thetaB", "v", "tab:purple")):
            if name not in methods or metric not in methods[name]["val"]:
                continue
            ax.scatter([s["methods"][name]["val"]["target_ppl"] for s in seeds],
                       [s["methods"][name]["val"][metric] for s in seeds], marker=marker,
                       s=90, color=color, edgecolor="white", zorder=5,
                       label={"thetaL": f"language base ({label})", "thetaA": "donor A",
                              "thetaB": "donor B"}[name])
        ax.axvline(bound, color="tab:green", ls="--",
                   label=f"constraint: {label} ppl ≤ {PPL_RATIO} × language base's")
        if family == "A":
            ax.axhline(chance[0], color="grey", ls=":", label="chance (uniform)")
        ax.set_xscale("log")
        ax.set_xlabel(f"validation {label} perplexity (lower = language kept)")
        ax.set_ylabel(ylabel)
        # Below the axes: the candidates fill every corner of the plot.
        ax.legend(fontsize=6, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    fig.suptitle(f"every sweep candidate into {label} ({len(seeds)} seed(s)); left of the "
                 "dashed line is feasible", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
