"""The ``maec`` command line: merges (and, below ``maec jobs``, the service client)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import click
from tqdm import tqdm

from maec_core.errors import MaecError
from maec_core.eval.cli import eval_command
from maec_core.recipe import Recipe, parse_recipe


class _Bar:
    """A tqdm bar per stage, fed by the engine's progress callback."""

    def __init__(self) -> None:
        self._bars: dict[str, tqdm[None]] = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        bar = self._bars.get(stage)
        if bar is None:
            bar = self._bars[stage] = tqdm(total=total, desc=stage, unit="tensor",
                                          file=sys.stderr, dynamic_ncols=True)
        bar.update(done - bar.n)

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()


T = TypeVar("T")


def _run(no_progress: bool, job: Callable[[_Bar | None], T]) -> T:
    """Run ``job`` with a progress bar (unless disabled); a MaecError exits 2 with its code."""
    bar = None if no_progress else _Bar()
    try:
        return job(bar)
    except MaecError as exc:
        error = exc
    finally:
        # Bars closed first, so the error line is not drawn over.
        if bar:
            bar.close()
    click.echo(f"error: {error}", err=True)
    sys.exit(2)


def _warn(recipe: Recipe) -> None:
    """Every field the recipe gives that the merge does not use, on stderr."""
    from maec_core.methods.registry import recipe_warnings

    for line in recipe_warnings(recipe):
        click.echo(f"warning: {line}", err=True)


def default_cache_dir() -> Path:
    """Where the command line keeps input digests and MAEC artifacts between runs:
    ``$XDG_CACHE_HOME/maec``, else ``~/.cache/maec`` (``--cache-dir`` or
    ``MAEC_CACHE_DIR`` choose another)."""
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(xdg) / "maec"


def _hash_cache(cache_dir: Path | None) -> Path:
    return (cache_dir or default_cache_dir()) / "sha256"


_cache_option = click.option(
    "--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
    envvar="MAEC_CACHE_DIR",
    help="keeps input digests and MAEC artifacts between runs "
         "(default: $XDG_CACHE_HOME/maec or ~/.cache/maec)")


@click.group()
@click.version_option(package_name="maec-service")
def main() -> None:
    """Merge checkpoints (MAEC and baselines) and talk to the merge service."""


@main.command()
@click.argument("recipe", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--device", default=None, help="cuda, cpu, ... (default: CUDA when present)")
@click.option("--overwrite", is_flag=True, help="replace an existing OUT_DIR")
@click.option("--no-progress", is_flag=True, help="no progress bar")
@_cache_option
def merge(recipe: Path, out_dir: Path, device: str | None, overwrite: bool,
          no_progress: bool, cache_dir: Path | None) -> None:
    """Merge the checkpoints named in RECIPE (mergekit YAML shape) into OUT_DIR."""
    from maec_core.maec.store import LocalArtifactStore
    from maec_core.run import run

    store = LocalArtifactStore((cache_dir or default_cache_dir()) / "artifacts")
    parsed = _run(True, lambda _bar: parse_recipe(recipe))
    _warn(parsed)
    result = _run(no_progress, lambda bar: run(
        parsed, out_dir, artifact_store=store, progress=bar, device=device,
        overwrite=overwrite, hash_cache=_hash_cache(cache_dir)))
    click.echo(f"wrote {out_dir} ({result.tensors} tensors, {result.seconds:.1f} s)")


@main.command()
@click.argument("recipe", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("artifact_dir", type=click.Path(path_type=Path))
@click.option("--ability", "ability", type=int, default=0, show_default=True,
              help="index of the ability in the recipe's abilities list")
@click.option("--device", default=None, help="cuda, cpu, ... (default: CUDA when present)")
@click.option("--overwrite", is_flag=True, help="replace an existing ARTIFACT_DIR")
@click.option("--no-progress", is_flag=True, help="no progress bar")
@_cache_option
def extract(recipe: Path, artifact_dir: Path, ability: int, device: str | None,
            overwrite: bool, no_progress: bool, cache_dir: Path | None) -> None:
    """MAEC stage 1: extract one ability of RECIPE into the artifact folder ARTIFACT_DIR."""
    from maec_core.maec.pipeline import extract as run_extract

    result = _run(no_progress, lambda bar: run_extract(
        parse_recipe(recipe), ability, artifact_dir, progress=bar, device=device,
        overwrite=overwrite, hash_cache=_hash_cache(cache_dir)))
    totals = result.metadata["totals"]
    click.echo(f"wrote {artifact_dir} (key {result.key}, {totals['kept']} key neurons in "
               f"{totals['tensors']} tensors, {result.seconds:.1f} s)")


@main.command()
@click.argument("recipe", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--device", default=None, help="cuda, cpu, ... (default: CUDA when present)")
@click.option("--overwrite", is_flag=True, help="replace an existing OUT_DIR")
@click.option("--no-progress", is_flag=True, help="no progress bar")
@_cache_option
def combine(recipe: Path, paths: tuple[Path, ...], device: str | None, overwrite: bool,
            no_progress: bool, cache_dir: Path | None) -> None:
    """MAEC stage 2: combine artifacts into RECIPE's language base.

    PATHS is ARTIFACT_DIR... OUT_DIR: one artifact folder per ability, in recipe order,
    then the output folder.
    """
    from maec_core.maec.pipeline import combine as run_combine

    if len(paths) < 2:
        raise click.UsageError("give at least one ARTIFACT_DIR and then OUT_DIR")
    *artifacts, out_dir = paths
    result = _run(no_progress, lambda bar: run_combine(
        parse_recipe(recipe), artifacts, out_dir, progress=bar, device=device,
        overwrite=overwrite, hash_cache=_hash_cache(cache_dir)))
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
@click.option("--device", default=None, help="cuda, cpu, ... (default: CUDA when present)")
@click.option("--overwrite", is_flag=True, help="replace an existing OUT_DIR")
@click.option("--no-progress", is_flag=True, help="no progress bar")
def extract_lora(artifact_dir: Path, out_dir: Path, rank: int, target_modules: tuple[str, ...],
                 base: str | None, device: str | None, overwrite: bool,
                 no_progress: bool) -> None:
    """Write a PEFT LoRA adapter approximating the ability vector in ARTIFACT_DIR (a MAEC
    artifact, from ``maec extract``) into OUT_DIR, by truncated SVD per module."""
    from maec_core.lora.export import export_artifact

    report = _run(no_progress, lambda bar: export_artifact(
        artifact_dir, out_dir, rank, target_modules=list(target_modules) or None,
        base_ref=base, device=device, overwrite=overwrite, progress=bar))
    click.echo(f"wrote {out_dir} ({len(report['modules'])} modules at rank {rank}; retained "
               f"energy min {report['retained_energy_min']:.4f}, "
               f"mean {report['retained_energy_mean']:.4f})")


main.add_command(eval_command)

if __name__ == "__main__":
    main()
