"""The ``maec`` command line: merges (and, below ``maec jobs``, the service client)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import click

from maec_core.cli_mergekit import MergekitFlags, mergekit_flags
from maec_core.cli_options import FLAG_NAMES as ALL_FLAGS
from maec_core.cli_options import RunFlags, run_flags
from maec_core.eval.cli import eval_command
from maec_core.gguf.sources import GgufInput
from maec_core.parsing import parse_recipe
from maec_core.recipe import Recipe


def _warn(recipe: Recipe) -> None:
    """Every field the recipe gives that the merge does not use, on stderr."""
    from maec_core.parsing import recipe_warnings

    for line in recipe_warnings(recipe):
        click.echo(f"warning: {line}", err=True)


@click.group()
@click.version_option(package_name="maec-service")
def main() -> None:
    """Merge checkpoints (MAEC and baselines) and talk to the merge service."""


@main.command()
@click.argument("recipe", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@run_flags(*ALL_FLAGS)
@mergekit_flags
@click.option("--gguf", "gguf_type", default=None, metavar="TYPE",
              help="also write the merged model as GGUF of this type into OUT_DIR "
                   "(f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0; docs/gguf.md)")
def merge(recipe: Path, out_dir: Path, flags: RunFlags, mergekit: MergekitFlags,
          gguf_type: str | None) -> None:
    """Merge the checkpoints named in RECIPE (mergekit YAML shape) into OUT_DIR.

    mergekit-yaml's options are accepted with the same meaning, or refused naming the
    reason (docs/compatibility.md lists each). A model may be a GGUF file (or a folder
    holding one): it is dequantized first, into the cache folder.
    """
    from maec_core.maec.store import LocalArtifactStore
    from maec_core.run import run

    refused = mergekit.refusals()
    if refused:
        for line in refused:
            click.echo(f"error: {line}", err=True)
        sys.exit(2)
    for line in mergekit.notes():
        click.echo(f"note: {line}", err=True)
    flags = dataclasses.replace(flags, device=flags.device or mergekit.device,
                                no_progress=flags.no_progress or mergekit.quiet)
    store = LocalArtifactStore(flags.cache / "artifacts")
    parsed = flags.run(lambda _ctx: mergekit.apply(parse_recipe(recipe)))
    _warn(parsed)
    if gguf_type is None and parsed.output is not None:
        gguf_type = parsed.output.gguf  # the recipe's `output: {gguf: TYPE}`
    parsed, ggufs = flags.run(lambda _ctx: _gguf_inputs(parsed, flags, gguf_type))
    result = flags.run(lambda ctx: run(parsed, out_dir, ctx.but(artifact_store=store)))
    click.echo(f"wrote {out_dir} ({result.tensors} tensors, {result.seconds:.1f} s)")
    if gguf_type is not None:
        from maec_core.gguf.output import add_gguf

        entry = flags.run(lambda _ctx: add_gguf(out_dir, gguf_type,
                                                {g.ref: g.info for g in ggufs}))
        click.echo(f"wrote {out_dir / entry['path']} ({entry['size']} bytes, "
                   f"sha256 {entry['sha256']})")


def _gguf_inputs(recipe: Recipe, flags: RunFlags, gguf_type: str | None
                 ) -> tuple[Recipe, list[GgufInput]]:
    """GGUF models dequantized (cached by sha256 under the cache folder), each with its
    lossy-merge warning; a GGUF output refused before the merge if it cannot be made."""
    from maec_core.gguf.sources import check_gguf_output, resolve_gguf

    recipe, ggufs = resolve_gguf(recipe, flags.cache / "gguf", flags.cache / "sha256")
    for g in ggufs:
        click.echo(f"warning: {g.warning}", err=True)
    if gguf_type is not None:
        check_gguf_output(recipe, gguf_type)
    return recipe, ggufs


@main.command()
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


@main.command()
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


@main.command("extract-lora")
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
    from maec_core.lora.export import export_artifact

    report = flags.run(lambda ctx: export_artifact(
        artifact_dir, out_dir, ctx, rank, target_modules=list(target_modules) or None,
        base_ref=base))
    click.echo(f"wrote {out_dir} ({len(report['modules'])} modules at rank {rank}; retained "
               f"energy min {report['retained_energy_min']:.4f}, "
               f"mean {report['retained_energy_mean']:.4f})")


main.add_command(eval_command)

if __name__ == "__main__":
    main()
