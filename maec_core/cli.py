"""The ``maec`` command line: merges (and, below ``maec jobs``, the service client)."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from tqdm import tqdm

from maec_core.errors import MaecError


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
def merge(recipe: Path, out_dir: Path, device: str | None, overwrite: bool,
          no_progress: bool) -> None:
    """Merge the checkpoints named in RECIPE (mergekit YAML shape) into OUT_DIR."""
    from maec_core.engine import run_recipe

    bar = None if no_progress else _Bar()
    try:
        result = run_recipe(recipe, out_dir, progress=bar, device=device, overwrite=overwrite)
    except MaecError as exc:
        if bar:
            bar.close()
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    if bar:
        bar.close()
    click.echo(f"wrote {out_dir} ({result.tensors} tensors, {result.seconds:.1f} s)")


if __name__ == "__main__":
    main()
