"""The ``maec`` command line: merges (and, below ``maec jobs``, the service client)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import click

from maec_core.cli_mergekit import MergekitFlags, mergekit_flags
from maec_core.cli_options import FLAG_NAMES as ALL_FLAGS
from maec_core.cli_options import RunFlags, run_flags
from maec_core.eval.cli import eval_command
from maec_core.gguf.sources import GgufInput
from maec_core.methods import all_methods
from maec_core.parsing import parse_recipe
from maec_core.recipe import Recipe


def _warn(recipe: Recipe) -> None:
    """Every field the recipe gives that the merge does not use, on stderr."""
    from maec_core.parsing import recipe_warnings

    for line in recipe_warnings(recipe):
        click.echo(f"warning: {line}", err=True)


@contextlib.contextmanager
def _imports_frozen() -> Iterator[None]:
    """Import the engine with the cyclic garbage collector off, then leave what was
    built out of every later collection (``gc.freeze``): torch and the engine build
    hundreds of thousands of objects that live as long as the process, and while they
    are imported they set off some 400 collections that free nothing, about 0.35 s of
    the merge's single-threaded start (re-enabled without the freeze, the first
    collection would walk them all). Reference counting frees the rest as before."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def _one_blas_thread() -> None:
    """Ask numpy's bundled OpenBLAS for no thread pool, before torch imports numpy: its
    threads start at import and spin waiting for work (0.04 s of CPU per thread when
    idle, ~0.13 s while the merge's start imports beside them on a two-core machine,
    taken from the merge's own threads), and a merge gives them none. Torch computes
    with its own BLAS (MKL) and threads, and numpy computes nothing here (tensor bytes
    pass through ``.numpy()`` views; the GGUF quantizers are element-wise), so no result
    depends on it. A value the user set is kept."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


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
    _one_blas_thread()
    with _imports_frozen():
        from maec_core.artifact_store import LocalArtifactStore
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


main.add_command(eval_command)
# A method's own commands (MAEC's extract, combine and extract-lora) come from its unit.
for _method in all_methods():
    for _command in _method.commands():
        main.add_command(_command)

if __name__ == "__main__":
    main()
