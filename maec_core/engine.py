"""The streaming merge engine: plan from headers, then one tensor at a time to disk.

``stream_merge`` is the shared loop (read inputs with prefetch, compute in float32 on
the best device, check finiteness, cast, append to the sharded writer, report progress,
honour cancellation); ``run_recipe`` drives it for the registered methods and hands
``merge_method: maec`` to the MAEC pipeline, which reuses the same loop.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from maec_core.card import model_card
from maec_core.checksums import BackgroundHasher
from maec_core.errors import Cancelled, NonFiniteOutput, RecipeError
from maec_core.io.folder import ModelFolder, open_model_folder
from maec_core.io.headers import TensorInfo
from maec_core.io.output import StagedOutput, output_config
from maec_core.io.reader import SAFETENSORS_NAMES, Prefetcher, TensorReader
from maec_core.io.writer import OutputTensor, ShardedWriter
from maec_core.manifest import MANIFEST_NAME, build_manifest
from maec_core.methods.base import TensorCall
from maec_core.methods.params import layer_index, resolve_params
from maec_core.methods.registry import get_impl
from maec_core.methods.specs import get_spec
from maec_core.plan import MergePlan, PlannedTensor, build_plan
from maec_core.recipe import Recipe, parse_recipe

# progress(stage, done, total)
ProgressFn = Callable[[str, int, int], None]
CancelFn = Callable[[], bool]
TORCH_DTYPE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def best_device(requested: str | None = None) -> torch.device:
    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class MergeResult:
    out_dir: Path
    manifest: dict[str, Any]
    tensors: int
    seconds: float
    stage_seconds: dict[str, float] = field(default_factory=dict)
    report: dict[str, Any] | None = None


def open_models(named: Mapping[str, str]) -> dict[str, ModelFolder]:
    """Open and validate each checkpoint folder (headers and configs only)."""
    return {key: open_model_folder(path) for key, path in named.items()}


def stream_merge(
    plan: MergePlan,
    recipe: Recipe,
    out_dir: Path,
    *,
    compute: Callable[[PlannedTensor, list[torch.Tensor]], torch.Tensor],
    read: Callable[[PlannedTensor], list[TensorInfo]],
    out_dtype: str,
    tokenizer_from: str,
    base_models: list[str],
    device: torch.device,
    progress: ProgressFn | None = None,
    cancel: CancelFn | None = None,
    stage: str = "merge",
    extra_json: Mapping[str, Any] | None = None,
    card_summary: str = "",
    manifest_extra: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    hash_inputs: Mapping[str, Sequence[Path]] | None = None,
) -> MergeResult:
    """Run ``compute`` over every planned tensor and publish a complete output folder.

    ``read(t)`` names the stored tensors to load for ``t``; ``compute`` receives them as
    float32 on ``device`` and returns the merged float32 tensor. Nothing appears at
    ``out_dir`` unless every step succeeds.
    """
    started = time.perf_counter()
    hasher = BackgroundHasher(
        {k: list(v) for k, v in (hash_inputs or {
            key: m.weight_files for key, m in plan.models.items()
        }).items()}
    )
    target = TORCH_DTYPE[out_dtype]
    st_dtype = SAFETENSORS_NAMES[target]
    outputs = [OutputTensor(t.name, t.shape, st_dtype) for t in plan.tensors]
    total = len(plan.tensors)
    with StagedOutput(out_dir, overwrite=overwrite) as staged, TensorReader() as reader:
        writer = ShardedWriter(staged.folder, outputs, recipe.shard_size_bytes())
        steps = [read(t) for t in plan.tensors]
        try:
            for i, (planned, raw) in enumerate(
                zip(plan.tensors, Prefetcher(reader, steps), strict=True)
            ):
                if cancel is not None and cancel():
                    raise Cancelled("merge cancelled")
                inputs = [r.to(device=device, dtype=torch.float32) for r in raw]
                del raw
                merged = compute(planned, inputs).to(target)
                del inputs
                # Checked after the cast: a float32 value beyond float16's range only
                # becomes inf there, and the cast tensor is the smaller one to scan.
                if not bool(torch.isfinite(merged).all()):
                    raise NonFiniteOutput(
                        f"merged tensor {planned.name!r} contains NaN or inf; nothing was "
                        "written (check the inputs and parameters)",
                        tensor=planned.name,
                    )
                writer.write(planned.name, merged)
                del merged
                if progress is not None:
                    progress(stage, i + 1, total)
            staged.add(writer.close())
        except BaseException:
            writer.abort()
            raise
        source = plan.models[tokenizer_from]
        staged.copy_side_files(source)
        staged.write_json("config.json", output_config(source.config, out_dtype))
        recipe_dump = recipe.model_dump(mode="json", exclude_none=True)
        staged.write_bytes("recipe.yaml", recipe.to_yaml().encode())
        staged.write_bytes(
            "README.md", model_card(recipe, base_models, card_summary).encode()
        )
        for name, doc in (extra_json or {}).items():
            staged.write_json(name, doc)
        digests = hasher.result()
        inputs_doc = {
            key: {"path": str(m.root), "files": digests.get(key, {})}
            for key, m in plan.models.items()
        }
        manifest = build_manifest(
            staged.files, inputs=inputs_doc, recipe=recipe_dump,
            extra=dict(manifest_extra or {}),
        )
        # Written last and outside staged.files: the manifest lists the others.
        (staged.folder / MANIFEST_NAME).write_text(
            json.dumps(manifest, indent=2, sort_keys=True) + "\n"
        )
        staged.commit()
    seconds = time.perf_counter() - started
    return MergeResult(out_dir, manifest, total, seconds, {stage: seconds})


def _model_keys(recipe: Recipe) -> tuple[str | None, list[tuple[str, str]]]:
    """(base key, [(key, path)] for the other models); keys are unique, readable names."""
    others: list[tuple[str, str]] = []
    seen: set[str] = set()
    base_key = recipe.base_model
    if base_key:
        seen.add(base_key)
    for m in recipe.models:
        if m.model == recipe.base_model:
            continue
        key, n = m.model, 2
        while key in seen:
            key, n = f"{m.model}#{n}", n + 1
        seen.add(key)
        others.append((key, m.model))
    return base_key, others


def run_method(
    recipe: Recipe,
    out_dir: Path,
    *,
    progress: ProgressFn | None = None,
    cancel: CancelFn | None = None,
    device: str | None = None,
    overwrite: bool = False,
) -> MergeResult:
    """Run one registered (non-MAEC) method."""
    spec = get_spec(recipe.merge_method)
    fn = get_impl(spec.name)
    base_key, others = _model_keys(recipe)
    named = dict(others)
    if base_key:
        named = {base_key: base_key, **named}
    folders = open_models(named)
    reference = base_key or others[0][0]
    plan = build_plan(folders, reference)
    out_dtype = recipe.dtype or plan.input_dtype
    entries = [m for m in recipe.models if m.model != recipe.base_model]
    other_keys = [k for k, _ in others]
    keys = ([base_key] if base_key else []) + other_keys
    dev = best_device(device)
    num_layers = plan.num_layers

    def read(t: PlannedTensor) -> list[TensorInfo]:
        return [t.sources[k] for k in keys]

    def compute(t: PlannedTensor, inputs: list[torch.Tensor]) -> torch.Tensor:
        base = inputs[0] if base_key else None
        models = inputs[1:] if base_key else inputs
        call = TensorCall(
            name=t.name,
            base=base,
            models=models,
            model_params=[
                spec.model_params.model_validate(resolve_params(e.parameters, t.name, num_layers))
                for e in entries
            ],
            params=spec.params.model_validate(
                resolve_params(recipe.parameters, t.name, num_layers)
            ),
            layer=layer_index(t.name),
            num_layers=num_layers,
        )
        return fn(call)

    tokenizer_from = reference
    if recipe.tokenizer_source and recipe.tokenizer_source != "base":
        if recipe.tokenizer_source not in folders:
            raise RecipeError(
                f"tokenizer_source {recipe.tokenizer_source!r} is not one of the recipe's models"
            )
        tokenizer_from = recipe.tokenizer_source
    return stream_merge(
        plan, recipe, Path(out_dir), compute=compute, read=read, out_dtype=out_dtype,
        tokenizer_from=tokenizer_from, base_models=list(named.values()), device=dev,
        progress=progress, cancel=cancel, overwrite=overwrite,
    )


def run_recipe(
    recipe: Recipe | Mapping[str, Any] | str | Path,
    out_dir: str | Path,
    *,
    progress: ProgressFn | None = None,
    cancel: CancelFn | None = None,
    device: str | None = None,
    overwrite: bool = False,
) -> MergeResult:
    """Validate ``recipe`` and write the merged checkpoint folder to ``out_dir``."""
    r = parse_recipe(recipe)
    if r.merge_method == "maec":
        from maec_core.maec.pipeline import run_maec

        result: MergeResult = run_maec(
            r, Path(out_dir), progress=progress, cancel=cancel, device=device,
            overwrite=overwrite,
        )
        return result
    return run_method(r, Path(out_dir), progress=progress, cancel=cancel, device=device,
                      overwrite=overwrite)
