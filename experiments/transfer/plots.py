"""Sweep and alignment plots for docs/experiments.md (matplotlib, Agg backend)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from experiments.transfer.config import Config

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


# The two targets: file-name prefix and label. T keeps the file names of the first run.
TARGETS = {"T": ("", "T"), "R": ("control_", "T′")}


def make_plots(cfg: Config, all_seeds: list[dict[str, Any]], chance: tuple[float, float],
               out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for target, (prefix, label) in TARGETS.items():
        seeds = [s["targets"][target] for s in all_seeds]
        written += _sweep_plots(plt, seeds, chance, out, prefix, label)
        written.append(_tradeoff(plt, seeds, chance, out / f"{prefix}tradeoff.png", label))
    written.append(_alignment(plt, all_seeds, out / "alignment.png"))
    return written


def _sweep_plots(plt: Any, seeds: list[dict[str, Any]], chance: tuple[float, float],
                 out: Path, prefix: str, label: str) -> list[Path]:
    written: list[Path] = []
    variants = [m for m in seeds[0]["methods"] if m.startswith("maec")]
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
    for method in seeds[0]["methods"]:
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
