"""How a run goes (``RunContext``) and what its output folder holds (``OutputSpec``).

Every entry of the library takes ``(recipe, out, ctx)``: the recipe says what to compute,
``out`` where to publish it, and the context how to run it (progress, cancellation,
device, whether to replace ``out``, the input-digest cache, the MAEC artifact store and
the engine's options). A layer passes its context on whole, changing a field with
:meth:`RunContext.but` where a step needs another value (a stage's own progress, no
overwrite for an intermediate folder), so a new run option is declared once, here.

Importing this module does not import torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from maec_core.runtime import CancelFn, EngineOptions, ProgressFn

if TYPE_CHECKING:
    from maec_core.artifact_store import ArtifactStore
    from maec_core.recipe import Recipe

__all__ = ["OutputSpec", "RunContext"]


@dataclass(frozen=True)
class RunContext:
    """How one run goes; never what it computes (except ``options.compute_dtype``).

    ``progress(stage, done, total)`` is called as tensors finish; ``cancel()`` returning
    True stops the run with ``Cancelled``. ``device`` defaults to CUDA when present.
    ``overwrite`` replaces an existing output folder. ``hash_cache`` is a folder keeping
    input-file digests between processes (None: this process only). ``artifact_store``
    keeps MAEC ability artifacts between runs (other methods have none; without a store
    MAEC extracts every ability afresh); ``artifact_scope``, when set, is part of every
    artifact key, so artifacts are shared only within one scope (the service: one per
    API key). ``manifest_file``: whether the run writes each folder's manifest.json
    (False: the caller writes it, once, from the manifest the run returns in memory, as
    the service does after naming the inputs). ``options``: compute dtype, GPU budget,
    finished-shard callbacks, a sink taking the tensors instead of a folder
    (:class:`~maec_core.runtime.EngineOptions`).
    """

    progress: ProgressFn | None = None
    cancel: CancelFn | None = None
    device: str | None = None
    overwrite: bool = False
    hash_cache: Path | None = None
    artifact_store: ArtifactStore | None = None
    artifact_scope: str = ""
    options: EngineOptions = field(default_factory=EngineOptions)
    # Local input path -> the reference the output records it by (recipe.yaml, the model
    # card, extra documents, the manifest's recipe and accounting, the returned report):
    # a job's worker sets it, once, so that nothing it publishes names the worker's own
    # paths and nothing needs renaming afterwards. Empty: paths are recorded as given.
    names: Mapping[str, str] = field(default_factory=dict)
    manifest_file: bool = True

    def but(self, **changes: Any) -> RunContext:
        """This context with ``changes`` applied (a new one: contexts are frozen)."""
        return dataclasses.replace(self, **changes)

    def cancelled(self) -> bool:
        """Whether the caller asked the run to stop."""
        return self.cancel is not None and self.cancel()

    def report(self, stage: str, done: int, total: int) -> None:
        """Report progress, when someone listens."""
        if self.progress is not None:
            self.progress(stage, done, total)


@dataclass(frozen=True)
class OutputSpec:
    """What a merge's output folder holds beside its weights, and where it goes.

    ``folder``: the output folder. ``recipe``: recorded as recipe.yaml and in the card
    and manifest (its ``out_shard_size`` sizes the shards). ``dtype``: the stored dtype
    of the weights. ``tokenizer_from``: the model key whose tokenizer, generation and
    config files are copied (``tokenizer_files`` replace the tokenizer's when a
    vocabulary was built). ``base_models``: named in the model card. ``extra_json``:
    further documents (name -> JSON), ``card_summary`` the card's method section,
    ``manifest_extra`` more manifest fields. ``hash_inputs``: the input files whose
    digests the manifest records (None: every model's weight files). ``config_dtype``:
    the dtype config.json names, when not ``dtype``.
    """

    folder: Path
    recipe: Recipe
    dtype: str
    tokenizer_from: str
    base_models: Sequence[str] = ()
    extra_json: Mapping[str, Any] | None = None
    card_summary: str = ""
    manifest_extra: Mapping[str, Any] | None = None
    tokenizer_files: Mapping[str, bytes] | None = None
    hash_inputs: Mapping[str, Sequence[Path]] | None = None
    # The dtype config.json names (None: ``dtype``); differs from the weights' where a
    # method saves float32 whatever the recipe's dtype, as mergekit does.
    config_dtype: str | None = None
