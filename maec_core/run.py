"""The one entry for any recipe: a parsed ``Recipe`` in, a published output folder out.

``merge_method: maec`` goes to the MAEC pipeline (extraction or artifact reuse, then
combination); every other method to the engine's streaming merge. Callers parse the
recipe once (``maec_core.recipe.parse_recipe``) and pass it on typed.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from maec_core.engine import run_method
from maec_core.errors import MaecError
from maec_core.lora.export import export_merge
from maec_core.maec.pipeline import run_maec
from maec_core.maec.store import ArtifactStore
from maec_core.recipe import Recipe
from maec_core.runtime import CancelFn, EngineOptions, MergeResult, ProgressFn

__all__ = ["run"]


def run(
    recipe: Recipe,
    out: Path,
    *,
    artifact_store: ArtifactStore | None = None,
    progress: ProgressFn | None = None,
    cancel: CancelFn | None = None,
    device: str | None = None,
    overwrite: bool = False,
    hash_cache: Path | None = None,
    options: EngineOptions | None = None,
) -> MergeResult:
    """Merge ``recipe`` into the folder ``out`` (published complete, or not at all).

    ``artifact_store`` keeps MAEC ability artifacts between runs (other methods have
    none; without a store MAEC extracts every ability afresh). ``progress(stage, done,
    total)`` is called as tensors finish; ``cancel()`` returning True stops the run with
    ``Cancelled``. ``device`` defaults to CUDA when present. ``hash_cache`` is a folder
    keeping input-file digests between processes (None: this process only).
    ``options``: compute dtype, GPU memory budget, a callback per finished output shard,
    or a sink that takes the merged tensors instead of the folder (nothing is written at
    ``out`` then).

    ``output: {format: lora}`` publishes a LoRA adapter of the merge's change to its base
    instead of the merged checkpoint (``maec_core.lora.export``).
    """
    if recipe.output is not None and recipe.output.format == "lora":
        if options is not None and options.sink is not None:
            raise MaecError("output format lora publishes an adapter, not the merged "
                            "tensors a sink takes: merge without the sink")
        # The merged checkpoint is an intermediate here: its shards are not the output,
        # so no finished-shard callback sees them.
        inner = (dataclasses.replace(options, on_shard=None, on_shard_open=None)
                 if options else None)
        merge = functools.partial(_merge, recipe, artifact_store=artifact_store,
                                  progress=progress, cancel=cancel, device=device,
                                  overwrite=False, hash_cache=hash_cache, options=inner)
        return export_merge(recipe, Path(out), merge, progress=progress, cancel=cancel,
                            device=device, overwrite=overwrite)
    return _merge(recipe, Path(out), artifact_store=artifact_store, progress=progress,
                  cancel=cancel, device=device, overwrite=overwrite, hash_cache=hash_cache,
                  options=options)


def _merge(
    recipe: Recipe,
    out: Path,
    *,
    artifact_store: ArtifactStore | None,
    progress: ProgressFn | None,
    cancel: CancelFn | None,
    device: str | None,
    overwrite: bool,
    hash_cache: Path | None,
    options: EngineOptions | None,
) -> MergeResult:
    """The merged checkpoint itself, by the recipe's method."""
    if recipe.merge_method == "maec":
        return run_maec(recipe, out, progress=progress, cancel=cancel, device=device,
                        overwrite=overwrite, artifact_store=artifact_store,
                        hash_cache=hash_cache, options=options)
    return run_method(recipe, Path(out), progress=progress, cancel=cancel, device=device,
                      overwrite=overwrite, hash_cache=hash_cache, options=options)
