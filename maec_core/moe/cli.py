"""``maec moe CONFIG OUT_DIR``: build a mixture of experts from a mergekit-moe config.

Torch is imported only when the command runs, so registering it costs the ``maec``
entry point nothing.
"""

from __future__ import annotations

from pathlib import Path

import click

from maec_core.cli_options import RunFlags, run_flags


@click.command("moe")
@click.argument("config", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--allow-all-same", "--i-understand-this-is-not-useful-without-training",
              "allow_all_same", is_flag=True,
              help="accept experts that are all one model (only useful to train further)")
@run_flags("overwrite", "no_progress", "cache_dir")
def moe_command(config: Path, out_dir: Path, allow_all_same: bool, flags: RunFlags) -> None:
    """Build the mixture of experts CONFIG describes (mergekit-moe's YAML) into OUT_DIR.

    Gate modes hidden, hidden_avg, cheap_embed, random and uniform_random; Mixtral and
    Qwen2-MoE outputs (docs/moe.md). Warnings (ignored keys among them) go to stderr.
    """
    from maec_core.moe.build import build_moe
    from maec_core.moe.config import parse_moe_config

    result = flags.run(lambda ctx: build_moe(
        parse_moe_config(config, allow_all_same=allow_all_same), out_dir, ctx))
    report = result.report or {}
    for warning in report.get("warnings", []):
        click.echo(f"warning: {warning}", err=True)
    click.echo(f"wrote {out_dir} ({report.get('architecture')}, {report.get('experts')} "
               f"experts, {result.tensors} tensors, {result.seconds:.1f} s)")
