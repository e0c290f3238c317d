"""``maec eval MODEL_DIR EVAL.yaml``: score a model folder, print the table, write the report.

Torch is imported only when the command runs, so registering the command costs the
``maec`` entry point nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from tqdm import tqdm

from maec_core.context import RunContext
from maec_core.errors import MaecError


class _Bars:
    """One progress bar per eval set, on stderr."""

    def __init__(self) -> None:
        self._bars: dict[str, tqdm[None]] = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        bar = self._bars.get(stage)
        if bar is None:
            bar = self._bars[stage] = tqdm(total=total, desc=stage, unit="batch",
                                           file=sys.stderr, dynamic_ncols=True)
        bar.update(done - bar.n)

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()


@click.command("eval")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("spec", metavar="EVAL.yaml",
                type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("eval_report.json"), show_default=True,
              help="where to write the report (every item of every set)")
@click.option("--device", default=None, help="cuda, cpu, ... (default: CUDA when present)")
@click.option("--label", default=None, help="the model's row name (default: MODEL_DIR's name)")
@click.option("--markdown", is_flag=True, help="print a markdown table (for model cards)")
@click.option("--no-progress", is_flag=True, help="no progress bars")
def eval_command(model_dir: Path, spec: Path, out: Path, device: str | None,
                 label: str | None, markdown: bool, no_progress: bool) -> None:
    """Score MODEL_DIR on the eval sets listed in EVAL.yaml; print the table, write the report.

    EVAL.yaml lists sets: {name, language, kind: perplexity|accuracy, path, ...}; set paths
    are relative to its folder.
    """
    from maec_core.eval.report import write_report
    from maec_core.eval.runner import evaluate

    bars = None if no_progress else _Bars()
    error: MaecError | None = None
    try:
        report = evaluate(model_dir, spec, RunContext(device=device, progress=bars),
                          label=label)
    except MaecError as exc:
        error = exc
    finally:
        # Bars closed first, so the table or the error line is not drawn over.
        if bars is not None:
            bars.close()
    if error is not None:
        click.echo(f"error: {error}", err=True)
        sys.exit(2)
    write_report(report, out)
    click.echo(report.markdown_table() if markdown else report.text_table(), nl=False)
    click.echo(f"wrote {out}", err=True)
