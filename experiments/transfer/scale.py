"""MAEC's key_ratio curve at two model sizes: does sparsity remove the ability at any size?

At the experiment's model size, MAEC at key_ratio 0.05 lost the ability that the dense
settings carried (docs/experiments.md). This runs the same curve at that size and at one
about 4× larger (hidden 384, 8 heads, MLP 1024: 3.9× the parameters), on the same data
and seed 0, θ0 on the same budget and the larger size's two fine-tunes at twice the steps
(``large-ft2x``, see ``SIZES``). At each size: θ0, the ability donor θA and the T′
language base θL′ (cached under ``experiments/transfer/cache`` like the main run's, so
the smaller size reuses what the main run's seed 0 trained), then MAEC (delta importance,
no control, every tensor kept by selection) swept over key_ratio × μ on T′ validation by
the project's sweep library. Per key_ratio the μ chosen on validation is scored on test.
``make experiment`` runs both sizes beside the main run.

    python -m experiments.transfer.scale --size large-ft2x  # the 4× size, θ0 included
    python -m experiments.transfer.scale --size small       # after the main run's seed 0
    python -m experiments.transfer.scale --report           # table, plot, RESULT line
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from experiments.transfer import lang
from experiments.transfer import model as M
from experiments.transfer.config import DEBUG, EVAL_VERSION, FULL, Config
from experiments.transfer.merges import discard, key_ratio_sweep, sweep
from experiments.transfer.run import (
    CACHE,
    MAEC_CACHE,
    ROOT,
    checkpoints_base,
    donor_a,
    eval_files,
    evaluate_folders,
    language_base,
    log,
    seed_data,
)
from maec_core.runtime import torch_threads

SEED = 0
TARGET = "R"  # T′, where the donor answers zero-shot: the curve has a ceiling to reach
LARGE = M.ModelSize(hidden=384, layers=4, heads=8, intermediate=1024)
KEY_RATIOS = list(FULL.sweep.key_ratio)
MUS = list(FULL.sweep.mu)
# Bump when the protocol changes (invalidates cached curves, not checkpoints).
SCALE_VERSION = 1


# The sizes compared: the experiment's, and the 4× one with its two fine-tunes (θA, θL′)
# given twice the steps. On the same 400 steps (``config("large")``, the 4× size on the
# smaller one's budgets) the larger donor learned the ability less well (S accuracy 0.67
# against 0.99). θ0's budget is the same for both (its final loss matched the smaller θ0's).
SIZES = ("small", "large-ft2x")


def config(size: str, debug: bool = False) -> Config:
    """The budgets of a size ("small", "large" or "large-ft2x"): the full run's (or, with
    ``debug``, the pipeline check's), at the experiment's model size or the 4× one. The
    names keep eval-set folders apart; checkpoint keys depend on the size and budgets, not
    the name, so "small" shares the full run's checkpoints and "large-ft2x" the θ0 of
    "large"."""
    cfg = DEBUG if debug else FULL
    if size == "small":
        return cfg
    large = replace(cfg, name=f"{cfg.name}-{size}", size=LARGE)
    if size == "large":
        return large
    return replace(large, ability=replace(cfg.ability, steps=2 * cfg.ability.steps),
                   language=replace(cfg.language, steps=2 * cfg.language.steps))


def best_per_key_ratio(rows: list[dict[str, Any]], objective: str = "target_acc"
                       ) -> dict[float, str]:
    """Per key_ratio, the candidate with the best validation objective (the first in grid
    order on a tie, the sweep library's rule)."""
    best: dict[float, dict[str, Any]] = {}
    for r in rows:
        k = r["knobs"]["key_ratio"]
        if k not in best or r["val"][objective] > best[k]["val"][objective]:
            best[k] = r
    return {k: r["id"] for k, r in sorted(best.items())}


def _result_path(cfg: Config) -> Path:
    blob = json.dumps({"cfg": repr(cfg), "seed": SEED, "key_ratios": KEY_RATIOS,
                       "mus": MUS, "eval": EVAL_VERSION, "scale": SCALE_VERSION},
                      sort_keys=True).encode()
    return CACHE / "results" / f"scale-{cfg.name}-{hashlib.sha256(blob).hexdigest()[:12]}.json"


def run_size(cfg: Config) -> dict[str, Any]:
    """One size's checkpoints, curve and test scores (cached as JSON)."""
    path = _result_path(cfg)
    if path.exists():
        log(f"scale {cfg.name}: results cached ({path.name})")
        cached: dict[str, Any] = json.loads(path.read_text())
        return cached
    started = time.perf_counter()
    data = seed_data(cfg, SEED)
    theta0 = checkpoints_base(cfg, SEED)
    donor = donor_a(cfg, SEED, data, theta0)
    language = language_base(cfg, SEED, TARGET, theta0)
    files = eval_files(cfg, SEED, data)
    val, test = files.get(TARGET, "val", "A"), files.get(TARGET, "test", "A")
    singles = evaluate_folders({"theta0": theta0, "thetaL": language, "thetaA": donor}, test)
    swept = key_ratio_sweep(theta0, donor, language, val, KEY_RATIOS, MUS)
    work = CACHE / "merges" / "scale" / cfg.name
    outcome = sweep(swept.recipe, work, MAEC_CACHE)
    chosen = best_per_key_ratio(outcome.rows)
    tested = evaluate_folders({cid: outcome.folders[cid] for cid in chosen.values()}, test)
    discard(outcome)
    by_id = {r["id"]: r for r in outcome.rows}
    curve = [{"key_ratio": k, "mu": by_id[cid]["knobs"]["mu"], "val": by_id[cid]["val"],
              "test": tested[cid]} for k, cid in chosen.items()]
    model = M.new_model(cfg.size, SEED)
    out = {"size": asdict(cfg.size), "params": sum(p.numel() for p in model.parameters()),
           "layer_params": sum(p.numel() for n, p in model.named_parameters()
                               if ".layers." in n),
           "singles": singles, "curve": curve, "sweep": outcome.rows,
           "seconds": time.perf_counter() - started}
    for point in curve:
        log(f"scale {cfg.name}: key_ratio {point['key_ratio']} (mu {point['mu']}) test "
            f"T′ acc {point['test']['target_acc']:.3f} ppl {point['test']['target_ppl']:.2f}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(path)
    return out


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| size | parameters | θA zero-shot | θL′ | " + " | ".join(
        f"key_ratio {k}" for k in KEY_RATIOS) + " |",
        "|---" * (4 + len(KEY_RATIOS)) + "|"]
    for size, r in results.items():
        cells = [f"{p['test']['target_acc']:.3f} (μ {p['mu']}, ppl "
                 f"{p['test']['target_ppl']:.1f})" for p in r["curve"]]
        lines.append(f"| {size} | {r['params'] / 1e6:.2f}M | "
                     f"{r['singles']['thetaA']['target_acc']:.3f} | "
                     f"{r['singles']['thetaL']['target_acc']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], chance: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for (size, r), color in zip(results.items(), ("tab:blue", "tab:orange", "tab:green"),
                                strict=False):
        xs = [p["key_ratio"] for p in r["curve"]]
        acc = [p["test"]["target_acc"] for p in r["curve"]]
        donor = r["singles"]["thetaA"]["target_acc"]
        label = f"{size} ({r['params'] / 1e6:.1f}M)"
        axes[0].plot(xs, acc, "o-", color=color, label=f"MAEC, {label}")
        axes[0].axhline(donor, color=color, ls="-.", label=f"θA zero-shot, {size}")
        axes[0].axhline(r["singles"]["thetaL"]["target_acc"], color=color, ls=":",
                        label=f"θL′ alone, {size}")
        axes[1].plot(xs, [p["test"]["target_ppl"] for p in r["curve"]], "o-", color=color,
                     label=label)
        axes[1].axhline(r["singles"]["thetaL"]["target_ppl"], color=color, ls=":")
    axes[0].axhline(chance, color="grey", ls=":", label="chance (uniform)")
    axes[0].set_ylabel("test T′ accuracy (μ chosen on validation)")
    axes[1].set_ylabel("test T′ perplexity at that μ (dotted: θL′)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("key_ratio")
        ax.legend(fontsize=7)
    fig.suptitle(f"MAEC key_ratio curve into T′ at two model sizes (seed {SEED})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def result_line(results: dict[str, dict[str, Any]]) -> str:
    fields = []
    for size, r in results.items():
        tag = size.replace("-", "_")
        fields.append(f"{tag}_params={r['params']}")
        fields.append(f"{tag}_donor_acc={r['singles']['thetaA']['target_acc']:.3f}")
        fields += [f"{tag}_kr{p['key_ratio']}_acc={p['test']['target_acc']:.3f}"
                   for p in r["curve"]]
    return "RESULT scale " + " ".join(fields)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--size", choices=SIZES)
    mode.add_argument("--report", action="store_true")
    ap.add_argument("--debug", action="store_true",
                    help="the pipeline check's budgets (seconds; the numbers mean nothing)")
    ap.add_argument("--out", type=Path, default=None,
                    help="where the plot goes (the table goes to the cache's results folder)")
    args = ap.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with torch_threads(FULL.threads):
        if args.size is not None:
            run_size(config(args.size, args.debug))
            return 0
        results = {size: run_size(config(size, args.debug)) for size in SIZES}
    out = args.out or (CACHE / "debug" / "scale" if args.debug
                       else ROOT / "docs" / "experiments")
    md = table(results)
    (CACHE / "results").mkdir(parents=True, exist_ok=True)
    (CACHE / "results" / f"scale{'-debug' if args.debug else ''}.md").write_text(md + "\n")
    # Both sizes are scored on the same items: one chance level.
    chance = lang.chance_levels(seed_data(config("small", args.debug), SEED).problems.test)[0]
    plot(results, chance, out / "scale_key_ratio.png")
    print(md)
    print(result_line(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
