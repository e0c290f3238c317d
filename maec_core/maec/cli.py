"""MAEC's own commands of the ``maec`` command line: its two stages run apart, and an
ability vector exported as a LoRA adapter. The method hands them to the command line
(:meth:`~maec_core.maec.method.Maec.commands`)."""

from __future__ import annotations

from pathlib import Path

import click

from maec_core.cli_options import FLAG_NAMES as ALL_FLAGS
from maec_core.cli_options import RunFlags, run_flags
from maec_core.parsing import parse_recipe


@click.command()
@click.argument("recipe", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("artifact_dir", type=click.Path(path_type=Path))
@click.option("--ability", "ability", type=int, default=0, show_default=True,
              help="index of the ability in the recipe's abilities list")
@run_flags(*ALL_FLAGS, target="ARTIFACT_DIR")
def extract(recipe: Path, artifact_dir: Path, ability: int, flags: RunFlags) -> None:
    """MAEC stage 1: extract one ability of RECIPE into the artifact folder ARTIFACT_DIR."""
    from maec_core.maec.pipeline import extract as run_extract

    result = flags.run(lambda ctx: run_extract(parse_recipe(recipe), ability, artifact_dir,
                                               ctx))
    totals = result.metadata["totals"]
    click.echo(f"wrote {artifact_dir} (key {result.key}, {totals['kept']} key neurons in "
               f"{totals['tensors']} tensors, {result.seconds:.1f} s)")


@click.command()
@click.argument("recipe", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@run_flags(*ALL_FLAGS)
def combine(recipe: Path, paths: tuple[Path, ...], flags: RunFlags) -> None:
    """MAEC stage 2: combine artifacts into RECIPE's language base.

    PATHS is ARTIFACT_DIR... OUT_DIR: one artifact folder per ability, in recipe order,
    then the output folder.
    """
    from maec_core.maec.pipeline import combine as run_combine

    if len(paths) < 2:
        raise click.UsageError("give at least one ARTIFACT_DIR and then OUT_DIR")
    *artifacts, out_dir = paths
    result = flags.run(lambda ctx: run_combine(parse_recipe(recipe), artifacts, out_dir, ctx))
    report = result.report or {}
    kept = ", ".join(f"{a['name']}: {a['tensors_kept']}/{a['tensors_carrying']} tensors"
                     for a in report.get("abilities", []))
    click.echo(f"wrote {out_dir} ({kept}; {result.seconds:.1f} s)")


@click.command("extract-lora")
@click.argument("artifact_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--rank", type=click.IntRange(1, 65536), required=True,
              help="the adapter's rank r")
@click.option("--target-module", "target_modules", multiple=True,
              help="a module name to export, as peft matches it (repeatable; default: "
                   "every 2-D weight inside the transformer blocks)")
@click.option("--base", default=None,
              help="recorded as the adapter's base_model_name_or_path (the language base "
                   "it is meant for)")
@run_flags("device", "overwrite", "no_progress")
def extract_lora(artifact_dir: Path, out_dir: Path, rank: int, target_modules: tuple[str, ...],
                 base: str | None, flags: RunFlags) -> None:
    """Write a PEFT LoRA adapter approximating the ability vector in ARTIFACT_DIR (a MAEC
    artifact, from ``maec extract``) into OUT_DIR, by truncated SVD per module."""
    from maec_core.maec.lora import export_artifact

    report = flags.run(lambda ctx: export_artifact(
        artifact_dir, out_dir, ctx, rank, target_modules=list(target_modules) or None,
        base_ref=base))
    click.echo(f"wrote {out_dir} ({len(report['modules'])} modules at rank {rank}; retained "
               f"energy min {report['retained_energy_min']:.4f}, "
               f"mean {report['retained_energy_mean']:.4f})")


COMMANDS: list[click.Command] = [extract, combine, extract_lora]
