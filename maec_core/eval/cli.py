"""``maec eval MODEL_DIR EVAL.yaml``: score a model folder, print the table, write the report.

Torch is imported only when the command runs, so registering the command costs the
``maec`` entry point nothing.
"""

from __future__ import annotations

from pathlib import Path

import click

from maec_core.cli_options import RunFlags, run_flags


@click.command("eval")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("spec", metavar="EVAL.yaml",
                type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("eval_report.json"), show_default=True,
              help="where to write the report (every item of every set)")
@click.option("--label", default=None, help="the model's row name (default: MODEL_DIR's name)")
@click.option("--markdown", is_flag=True, help="print a markdown table (for model cards)")
@run_flags("device", "no_progress", bars="bars")
def eval_command(model_dir: Path, spec: Path, out: Path, label: str | None, markdown: bool,
                 flags: RunFlags) -> None:
    """Score MODEL_DIR on the eval sets listed in EVAL.yaml; print the table, write the report.

    EVAL.yaml lists sets: {name, language, kind: perplexity|accuracy, path, ...}, or
    lm-evaluation-harness tasks: {name, kind: lm_eval, task, limit, num_fewshot, path: a
    folder of task YAMLs}; paths are relative to its folder.
    """
    from maec_core.eval.report import write_report
    from maec_core.eval.runner import evaluate

    report = flags.run(lambda ctx: evaluate(model_dir, spec, ctx, label=label), unit="batch")
    write_report(report, out)
    click.echo(report.markdown_table() if markdown else report.text_table(), nl=False)
    click.echo(f"wrote {out}", err=True)
