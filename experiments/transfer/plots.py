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


def make_plots(cfg: Config, seeds: list[dict[str, Any]], chance: tuple[float, float],
               out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    variants = [m for m in seeds[0]["methods"] if m.startswith("maec")]
    langbase = statistics.fmean(s["methods"]["thetaL"]["val"]["T_acc"] for s in seeds)
    donor = statistics.fmean(s["methods"]["thetaA"]["val"]["T_acc"] for s in seeds)
    for knob in KNOBS:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for v in variants:
            # Each variant's own grid (the first MAEC variant has a finer one).
            xs = sorted({r["knobs"][knob] for r in seeds[0]["methods"][v]["sweep"]})
            axes[0].plot(xs, [_mean_best(seeds, v, knob, x, "T_acc") for x in xs], "o-",
                         label=v)
            axes[1].plot(xs, [_mean_at(seeds, v, knob, x, "T_acc") for x in xs], "o-",
                         label=v)
        for ax, title in zip(axes, ("best over the other two knobs",
                                    "other knobs at the chosen setting"), strict=True):
            ax.axhline(chance[0], color="grey", ls=":", label="chance (uniform)")
            ax.axhline(langbase, color="black", ls="--", label="θL alone")
            ax.axhline(donor, color="tab:red", ls="-.", label="θA alone (zero-shot T)")
            ax.set_xlabel(knob)
            ax.set_ylabel("validation T accuracy (mean over seeds)")
            ax.set_title(title, fontsize=10)
            if knob == "key_ratio":
                ax.set_xscale("log")
        axes[1].legend(fontsize=7)
        fig.suptitle(f"MAEC sweep: {knob} ({len(seeds)} seeds)")
        fig.tight_layout()
        path = out / f"sweep_{knob}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for s in seeds:
        a = s["alignment_theta0"]
        layers = list(range(len(a["parallel"])))
        ax.plot(layers, a["parallel"], "o-", color="tab:blue",
                label="parallel S/T" if s is seeds[0] else None)
        ax.plot(layers, a["mismatched"], "o--", color="tab:orange",
                label="mismatched S/T" if s is seeds[0] else None)
        ax.plot(layers, a["centred_parallel"], "s-", color="tab:green",
                label="parallel, centred per language" if s is seeds[0] else None)
    ax.set_xlabel("layer (0 = embeddings)")
    ax.set_ylabel("cosine of mean-pooled hidden states")
    ax.set_title("θ0: do parallel S and T sentences meet? (one line per seed)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "alignment.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for method in seeds[0]["methods"]:
        xs = [s["methods"][method]["test"]["T_ppl"] for s in seeds]
        ys = [s["methods"][method]["test"]["T_acc"] for s in seeds]
        ax.scatter(xs, ys, label=method, s=18)
    ax.axhline(chance[0], color="grey", ls=":", label="chance (uniform)")
    ax.set_xscale("log")
    ax.set_xlabel("T perplexity (test, lower = language kept)")
    ax.set_ylabel("T accuracy (test)")
    ax.set_title("every method at its chosen setting, one point per seed", fontsize=10)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    path = out / "tradeoff.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written
