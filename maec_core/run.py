"""The one entry for any recipe: a parsed ``Recipe`` in, a published output folder out.

A tensor method goes to the engine's streaming merge (or, when compiled kernels take all
of it, to ``maec_core.kernel_merge``, which never imports torch); a method with a
pipeline of its own (MAEC: extraction or artifact reuse, then combination) runs it.
Callers parse the recipe once (``maec_core.parsing.parse_recipe``) and pass it on typed,
with the run's :class:`~maec_core.context.RunContext`.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from maec_core.context import RunContext
from maec_core.errors import MaecError
from maec_core.methods import TensorMethod, get_method
from maec_core.methods.base import PhasedMerge
from maec_core.naming import renamed
from maec_core.recipe import Recipe
from maec_core.runtime import MergeResult

__all__ = ["phased", "run"]


def run(recipe: Recipe, out: Path, ctx: RunContext | None = None) -> MergeResult:
    """Merge ``recipe`` into the folder ``out`` (published complete, or not at all), run
    as ``ctx`` says (progress, cancel, device, overwrite, digest cache, artifact store,
    engine options; :class:`~maec_core.context.RunContext`). With ``ctx.options.sink``
    the merged tensors go to the sink and nothing is written at ``out``.

    ``output: {format: lora}`` publishes a LoRA adapter of the merge's change to its base
    instead of the merged checkpoint (``maec_core.lora.export``).
    """
    ctx = ctx or RunContext()
    result = _run(recipe, Path(out), ctx)
    # What the run returns names its inputs as its manifest does (``ctx.names``): the
    # report too, so that no caller renames anything afterwards.
    return dataclasses.replace(result, report=renamed(result.report, ctx.names))


def _run(recipe: Recipe, out: Path, ctx: RunContext) -> MergeResult:
    if recipe.output is not None and recipe.output.format == "lora":
        if ctx.options.sink is not None:
            raise MaecError("output format lora publishes an adapter, not the merged "
                            "tensors a sink takes: merge without the sink")
        # Imported here: only an adapter output needs it (and safetensors' writer).
        from maec_core.lora.export import export_merge

        # The merged checkpoint is an intermediate here: its shards are not the output,
        # so no finished-shard callback sees them.
        inner = ctx.but(overwrite=False, options=dataclasses.replace(
            ctx.options, on_shard=None, on_shard_open=None))
        return export_merge(recipe, Path(out), ctx,
                            functools.partial(_merge, recipe, ctx=inner))
    return _merge(recipe, Path(out), ctx)


def _merge(recipe: Recipe, out: Path, ctx: RunContext) -> MergeResult:
    """The merged checkpoint itself, by the recipe's method."""
    method = get_method(recipe.merge_method)
    if isinstance(method, TensorMethod):
        # A merge compiled kernels take whole runs without torch (most published
        # recipes); the engine, which imports it, runs the others. Both imported here:
        # loading a command imports neither numpy nor torch.
        from maec_core.kernel_merge import kernel_merge

        merged = kernel_merge(recipe, Path(out), ctx)
        if merged is not None:
            return merged
        from maec_core.engine import run_method

        return run_method(recipe, Path(out), ctx)
    return method.run(recipe, Path(out), ctx)


def phased(recipe: Recipe) -> PhasedMerge | None:
    """How a merge of ``recipe`` (its inputs local) runs split into parts in phases, when
    its method decides something over the whole model (MAEC); None: it splits by shards
    alone (a tensor method) or not at all."""
    if recipe.output is not None and recipe.output.format == "lora":
        return None
    return get_method(recipe.merge_method).phased(recipe)
