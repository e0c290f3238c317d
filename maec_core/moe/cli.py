"""``maec moe CONFIG OUT_DIR``: build a mixture of experts from a mergekit-moe config.

Torch is imported only when the command runs, so registering it costs the ``maec``
entry point nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from tqdm import tqdm

from maec_core.errors import MaecError


class _Bar:
    """One progress bar over the output tensors, on stderr."""

    def __init__(self) -> None:
        self._bar: tqdm[None] | None = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self._bar is None:
            self._bar = tqdm(total=total, desc=stage, unit="tensor", file=sys.stderr,
                             dynamic_ncols=True)
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


@click.command("moe")
@click.argument("config", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--allow-all-same", "--i-understand-this-is-not-useful-without-training",
              "allow_all_same", is_flag=True,
              help="accept experts that are all one model (only useful to train further)")
@click.option("--overwrite", is_flag=True, help="replace an existing OUT_DIR")
@click.option("--no-progress", is_flag=True, help="no progress bar")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              envvar="MAEC_CACHE_DIR",
              help="keeps input digests between runs (default: $XDG_CACHE_HOME/maec or "
                   "~/.cache/maec)")
def moe_command(config: Path, out_dir: Path, allow_all_same: bool, overwrite: bool,
                no_progress: bool, cache_dir: Path | None) -> None:
    """Build the mixture of experts CONFIG describes (mergekit-moe's YAML) into OUT_DIR.

    Gate modes hidden, hidden_avg, cheap_embed, random and uniform_random; Mixtral and
    Qwen2-MoE outputs (docs/moe.md). Warnings (ignored keys among them) go to stderr.
    """
    from maec_core.cli import default_cache_dir
    from maec_core.moe.build import build_moe
    from maec_core.moe.config import parse_moe_config

    bar = None if no_progress else _Bar()
    error: MaecError | None = None
    try:
        parsed = parse_moe_config(config, allow_all_same=allow_all_same)
        result = build_moe(parsed, out_dir, progress=bar, overwrite=overwrite,
                           hash_cache=(cache_dir or default_cache_dir()) / "sha256")
    except MaecError as exc:
        error = exc
    finally:
        if bar is not None:
            bar.close()
    if error is not None:
        click.echo(f"error: {error}", err=True)
        sys.exit(2)
    report = result.report or {}
    for warning in report.get("warnings", []):
        click.echo(f"warning: {warning}", err=True)
    click.echo(f"wrote {out_dir} ({report.get('architecture')}, {report.get('experts')} "
               f"experts, {result.tensors} tensors, {result.seconds:.1f} s)")
