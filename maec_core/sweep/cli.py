"""``maec sweep RECIPE.yaml SWEEP.yaml OUT``: run a parameter sweep locally.

SWEEP.yaml is the ``sweep:`` block (grid, objective, constraint, publish), optionally
with ``evaluate:`` (the eval sets) and ``evaluate_inputs:``; without them the recipe's
own are used. Relative eval set paths are taken from the folder of the file naming them.
With ``publish: all`` every candidate is kept under ``OUT/candidates/<id>/``.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import click
import yaml

from maec_core.cli_options import RunFlags, run_flags
from maec_core.errors import MaecError, SweepError


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SweepError(f"cannot read {path.name}: {exc}") from None
    if not isinstance(doc, dict):
        raise SweepError(f"{path.name} must be a YAML mapping")
    return doc


def _local_sets(sets: Any, base_dir: Path) -> list[dict[str, Any]]:
    """Eval set entries with their paths resolved against ``base_dir``."""
    from maec_core.eval.sets import parse_spec

    spec = parse_spec(yaml.safe_dump({"sets": sets}), source="evaluate", base_dir=base_dir)
    return [s.model_dump(exclude_none=True) for s in spec.sets]


def load_sweep_recipe(recipe_path: Path, sweep_path: Path) -> Any:
    """The recipe with the sweep (and eval sets) of SWEEP.yaml, paths made absolute."""
    from maec_core.parsing import parse_recipe

    data = _read_yaml(recipe_path)
    block = _read_yaml(sweep_path)
    if isinstance(block.get("sweep"), dict):
        # The block under a top-level sweep: key, evaluate beside it.
        block = {**block["sweep"], **{k: v for k, v in block.items() if k != "sweep"}}
    if "evaluate" in block:
        data["evaluate"] = _local_sets(block.pop("evaluate"), sweep_path.parent)
    elif "evaluate" in data:
        data["evaluate"] = _local_sets(data["evaluate"], recipe_path.parent)
    if "evaluate_inputs" in block:
        data["evaluate_inputs"] = block.pop("evaluate_inputs")
    data["sweep"] = block
    return parse_recipe(data)


@click.command("sweep")
@click.argument("recipe", metavar="RECIPE.yaml",
                type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("sweep", metavar="SWEEP.yaml",
                type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("out_dir", metavar="OUT", type=click.Path(path_type=Path))
@run_flags("device", "cache_dir")
@click.option("--resident-mb", type=click.IntRange(min=0), default=None,
              help="MB of memory a MAEC sweep may hold its language base (then ability "
                   "vectors) in, to read them once for all candidates (default: half the "
                   "available memory less the scoring model; 0: read them per candidate)")
def sweep_command(recipe: Path, sweep: Path, out_dir: Path, resident_mb: int | None,
                  flags: RunFlags) -> None:
    """Merge and evaluate every candidate of SWEEP.yaml's grid over RECIPE.yaml; write the
    winner to OUT with eval_report.json, leaderboard.json and sweep.png."""
    from maec_core.artifact_store import LocalArtifactStore
    from maec_core.sweep.grid import Candidate
    from maec_core.sweep.runner import SweepOptions, run_sweep

    cache = flags.cache
    staged = out_dir.with_name(f".{out_dir.name}.candidates")

    def keep(cand: Candidate, folder: Path, _manifest: dict[str, Any]) -> None:
        shutil.copytree(folder, staged / cand.id)

    def announce(i: int, n: int) -> None:
        if i < n:
            click.echo(f"candidate {i + 1}/{n}", err=True)

    try:
        parsed = load_sweep_recipe(recipe, sweep)
        ctx = flags.context().but(artifact_store=LocalArtifactStore(cache / "artifacts"))
        result = run_sweep(parsed, out_dir, ctx, SweepOptions(
            keep=keep, announce=announce,
            resident_budget=None if resident_mb is None else resident_mb * 10**6))
    except MaecError as exc:
        shutil.rmtree(staged, ignore_errors=True)
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    if staged.exists():
        staged.rename(out_dir / "candidates")
    click.echo(result.board.markdown(), nl=False)
    click.echo(f"winner {result.board.winner}: {result.board.why}")
    click.echo(f"wrote {out_dir} ({len(result.board.rows)} candidates, "
               f"{result.extractions} extraction(s), {result.seconds:.1f} s)", err=True)
