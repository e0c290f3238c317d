"""A merge's output folder, around its weights: what every merge of registered methods
writes and checks the same way, whether the engine computes it with torch or
``maec_core.kernel_merge`` with a compiled kernel alone.

Where each stored tensor goes (:func:`plan_accounting`); progress and cancellation
(:func:`ticker`); and :func:`publish_folder`: the shards written into a staged folder
while the inputs are hashed on a thread, then the model's definition files, recipe, card
and manifest, and the folder renamed into place only when all of it succeeded. Nothing
here imports torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from maec_core.accounting import Accounting, Uses, account
from maec_core.card import model_card
from maec_core.checksums import BackgroundHasher
from maec_core.context import OutputSpec, RunContext
from maec_core.errors import Cancelled
from maec_core.io.headers import TensorInfo
from maec_core.io.output import StagedOutput, output_config
from maec_core.io.writer import OutputTensor, ShardedWriter, WrittenFile
from maec_core.manifest import build_manifest, write_manifest
from maec_core.naming import renamed
from maec_core.plan import MergePlan, PlannedTensor
from maec_core.recipe import Recipe
from maec_core.recipe.chat_template import resolve_chat_template, with_chat_template

__all__ = ["STALE_TOKENIZER_FILES", "plan_accounting", "publish_folder", "ticker",
           "write_definition"]

# Tokenizer files left out when the merge writes its own tokenizer.json.
STALE_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "added_tokens.json",
                         "tokenizer.model", "vocab.json", "merges.txt")


def plan_accounting(plan: MergePlan, read: Callable[[PlannedTensor], list[TensorInfo]],
                    feeds: Callable[[PlannedTensor], Sequence[str]] | None = None,
                    added: Collection[str] = ()) -> Accounting:
    """Where every stored tensor of the plan's models goes: into the output tensors
    whose inputs it feeds (``feeds``, else what ``read`` loads), or left out as the plan
    says (TensorUnaccounted when neither, or both). ``added``: output tensors that also
    take values from outside the plan's models."""
    def made_of(t: PlannedTensor) -> Uses:
        if feeds is not None:
            return t.name, [(k, t.sources[k]) for k in feeds(t)]
        loaded = read(t)
        return t.name, [(k, info) for k, info in t.sources.items() if info in loaded]

    return account(plan.models, map(made_of, plan.tensors), plan.left_out, added)


def ticker(ctx: RunContext, stage: str, total: int) -> Callable[[int], None]:
    def tick(i: int) -> None:
        """Called as tensor ``i`` starts: report the ``i`` finished, honour cancel."""
        if i > 0:
            ctx.report(stage, i, total)
        if ctx.cancelled():
            raise Cancelled("merge cancelled")

    return tick


def publish_folder(
    plan: MergePlan,
    output: OutputSpec,
    ctx: RunContext,
    weights: Callable[[ShardedWriter], list[WrittenFile]],
    dtype: str,
    accounting: Accounting | None,
) -> dict[str, Any]:
    """Publish the merge at ``output.folder``: ``weights`` writes every planned tensor
    (stored as ``dtype``, a safetensors name) into the shards of a staged folder while
    the inputs are hashed for the manifest on a thread, then the definition files,
    recipe, card and manifest are added and the folder renamed into place; its manifest.
    Nothing appears at ``output.folder`` unless every step succeeds."""
    options = ctx.options
    outputs = [OutputTensor(t.name, t.shape, dtype) for t in plan.tensors]
    files = output.hash_inputs or {key: m.weight_files for key, m in plan.models.items()}
    present = options.present
    with StagedOutput(output.folder, overwrite=ctx.overwrite) as staged:
        # With ``present``, only the files present whole are hashed (a file held in part
        # hashes to no digest of its content).
        hasher = BackgroundHasher({k: [p for p in v if present is None
                                       or present(p, 0, p.stat().st_size)]
                                   for k, v in files.items()}, cache=ctx.hash_cache)
        try:
            staged.add(weights(ShardedWriter(
                staged.folder, outputs, output.recipe.shard_size_bytes(), parallel_io=True,
                on_shard=options.on_shard, on_shard_open=options.on_shard_open,
                done=options.done_shards, part=options.part)))
        except BaseException:
            hasher.stop()
            raise
        # The definition from the inputs as given; the documents naming them, renamed.
        write_definition(staged, plan, output=output)
        manifest = _finish_folder(staged, hasher, plan, _recorded(output, ctx.names),
                                  accounting, ctx.names)
        if ctx.manifest_file:
            # Written last and outside staged.files: the manifest lists the others.
            write_manifest(staged.folder, manifest)
        staged.commit()
    return manifest


def write_definition(staged: StagedOutput, plan: MergePlan, *, output: OutputSpec) -> None:
    """Write the files that define the merged model beside its weights, all that
    transformers reads to build the model and its tokenizer: the tokenizer and
    generation files (copied, or a built vocabulary's) and config.json (the output
    dtype and the plan's changes applied). The output folder's first files, and a
    sink's skeleton (``EngineOptions.skeleton``)."""
    source = plan.models[output.tokenizer_from]
    # A built vocabulary: its tokenizer files, and none of the source's slow-tokenizer
    # files (they would describe the old vocabulary).
    skip = STALE_TOKENIZER_FILES if output.tokenizer_files else ()
    files = {p.name: p.read_bytes() for p in source.side_files() if p.name not in skip}
    files.update(output.tokenizer_files or {})
    template = resolve_chat_template(output.recipe.chat_template,
                                     [m.root for m in plan.models.values()])
    if template is not None:
        files = with_chat_template(files, template)
    for name, data in files.items():
        staged.write_bytes(name, data)
    staged.write_json("config.json",
                      output_config(source.config, output.config_dtype or output.dtype,
                                    plan.config_updates))


def _recorded(output: OutputSpec, names: Mapping[str, str]) -> OutputSpec:
    """``output`` as it is recorded: every input path in ``names`` replaced by its
    reference in the recipe, the card's base models and the extra documents."""
    if not names:
        return output
    recipe = Recipe.model_validate(renamed(output.recipe.model_dump(mode="json",
                                                                    exclude_none=True), names))
    return dataclasses.replace(
        output, recipe=recipe, base_models=renamed(list(output.base_models), names),
        extra_json=renamed(dict(output.extra_json or {}), names) or None)


def _finish_folder(staged: StagedOutput, hasher: BackgroundHasher, plan: MergePlan,
                   output: OutputSpec, accounting: Accounting | None,
                   names: Mapping[str, str] | None) -> dict[str, Any]:
    """Write the recipe, card and extra documents; returns the manifest listing them
    and the files written before (written by the caller, last)."""
    recipe = output.recipe
    recipe_dump = recipe.model_dump(mode="json", exclude_none=True)
    staged.write_bytes("recipe.yaml", recipe.to_yaml().encode())
    staged.write_bytes("README.md", model_card(recipe, list(output.base_models),
                                               output.card_summary).encode())
    for name, doc in (output.extra_json or {}).items():
        staged.write_json(name, doc)
    digests = hasher.result()
    inputs_doc = {
        key: {"path": str(m.root), "files": digests.get(key, {})}
        for key, m in plan.models.items()
    }
    return build_manifest(
        staged.files, inputs=inputs_doc, recipe=recipe_dump,
        extra=dict(output.manifest_extra or {}), accounting=accounting, names=names,
    )


