"""Write a PEFT LoRA adapter approximating a change to a base, by truncated SVD per module.

For each target module (a 2-D weight, by default every one inside the transformer
blocks) the delta ``D = merged - base`` is factored ``D ~= B @ A`` with ``B = U_r S_r^½``
and ``A = S_r^½ V_rᵀ`` (the best rank-r approximation, Eckart-Young), written as peft
names them with ``lora_alpha = r`` (scale 1). The report gives each module's retained
energy, ``sum(kept s²) / sum(s²)`` (1.0 for a zero delta). A module whose smaller side is
below ``r`` is padded with zero rows, so one ``r`` holds for all and it stays exact.

The entry is :func:`export_merge` (a recipe's ``output: {format: lora}``: the merge is
written to a temporary folder beside the output, then streamed against its base, tensor
by tensor); a method exports its own artifacts with the same pieces (``select_targets``,
``factor_all``, ``write_adapter``, ``publish``), as MAEC's ability vectors are.
Weights are laid out as ``nn.Linear`` stores them, ``(out, in)``.
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from maec_core.checksums import sha256_file
from maec_core.context import RunContext
from maec_core.errors import Cancelled, OutputExists, RecipeError
from maec_core.io.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LORA_A, LORA_B, PEFT_PREFIX
from maec_core.io.folder import ModelFolder, open_model_folder
from maec_core.io.output import StagedOutput
from maec_core.io.reader import TensorReader
from maec_core.io.writer import WrittenFile
from maec_core.manifest import build_manifest, write_manifest
from maec_core.naming import renamed
from maec_core.recipe import OutputFormat, Recipe
from maec_core.runtime import MergeResult, best_device

REPORT_NAME = "lora_report.json"
_SUFFIX = ".weight"


@dataclass(frozen=True)
class ModuleFactors:
    """One module's factors (CPU, float32) and how much of its delta they keep."""

    module: str
    a: torch.Tensor  # (r, in)
    b: torch.Tensor  # (out, r)
    energy: float


def _module(name: str) -> str:
    return name[: -len(_SUFFIX)]


def _in_blocks(name: str) -> bool:
    parts = name.split(".")
    return any(p == "layers" and i + 1 < len(parts) and parts[i + 1].isdigit()
               for i, p in enumerate(parts))


def _matches(module: str, target: str) -> bool:
    # peft's rule for a list of target names: the whole name, or its last dotted parts.
    return module == target or module.endswith("." + target)


def select_targets(shapes: Iterable[tuple[str, tuple[int, ...]]],
                   target_modules: list[str] | None) -> list[str]:
    """The weight names to export, in the given order: 2-D ``*.weight`` tensors inside
    the blocks, or those whose module matches one of ``target_modules``."""
    names = [n for n, shape in shapes if n.endswith(_SUFFIX) and len(shape) == 2]
    if target_modules is None:
        return [n for n in names if _in_blocks(n)]
    chosen = [n for n in names if any(_matches(_module(n), t) for t in target_modules)]
    unmatched = [t for t in target_modules
                 if not any(_matches(_module(n), t) for n in chosen)]
    if unmatched:
        raise RecipeError(f"output target_modules {unmatched} match no 2-D weight of the "
                          "model", target_modules=unmatched)
    return chosen


def low_rank_factors(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(A, B, retained energy)``: the rank-``rank`` truncated SVD of the 2-D ``delta``
    split evenly, ``B @ A`` its best approximation; zero-padded up to ``rank``."""
    u, s, vh = torch.linalg.svd(delta.to(torch.float32), full_matrices=False)
    k = min(rank, s.numel())
    total = float(s.square().sum())
    energy = float(s[:k].square().sum()) / total if total > 0 else 1.0
    root = s[:k].sqrt()
    a = torch.zeros(rank, delta.shape[1], dtype=torch.float32, device=delta.device)
    b = torch.zeros(delta.shape[0], rank, dtype=torch.float32, device=delta.device)
    a[:k] = root[:, None] * vh[:k]
    b[:, :k] = u[:, :k] * root
    return a, b, min(energy, 1.0)


def adapter_config(rank: int, modules: list[str], base_ref: str | None,
                   base_config: dict[str, Any] | None) -> dict[str, Any]:
    """A peft LoraConfig document: scale 1 (``lora_alpha = r``), the exported modules'
    names as targets."""
    archs = (base_config or {}).get("architectures") or []
    causal = any(str(a).endswith("ForCausalLM") for a in archs)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM" if causal else None,
        "base_model_name_or_path": base_ref,
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}),
    }


def write_adapter(staged: StagedOutput, factors: list[ModuleFactors], rank: int,
                  base_ref: str | None, base_config: dict[str, Any] | None,
                  dtype: torch.dtype) -> dict[str, Any]:
    """Write the adapter weights, its config and the report into ``staged``; return the
    report document."""
    tensors: dict[str, torch.Tensor] = {}
    for f in factors:
        tensors[PEFT_PREFIX + f.module + LORA_A] = f.a.to(dtype).contiguous()
        tensors[PEFT_PREFIX + f.module + LORA_B] = f.b.to(dtype).contiguous()
    path = staged.folder / ADAPTER_WEIGHTS
    save_file(tensors, str(path), metadata={"format": "pt"})
    staged.add([WrittenFile(ADAPTER_WEIGHTS, path.stat().st_size,
                            sha256_file(path, use_cache=False))])
    staged.write_json(ADAPTER_CONFIG, adapter_config(
        rank, [f.module for f in factors], base_ref, base_config))
    energies = [f.energy for f in factors]
    report = {
        "rank": rank,
        "modules": {f.module: {"retained_energy": round(f.energy, 6)} for f in factors},
        "retained_energy_min": round(min(energies), 6) if energies else 1.0,
        "retained_energy_mean": round(sum(energies) / len(energies), 6) if energies else 1.0,
    }
    return report


def factor_all(deltas: Iterator[tuple[str, torch.Tensor]], total: int, rank: int,
                ctx: RunContext) -> list[ModuleFactors]:
    """Each module's rank-``rank`` factors, on ``ctx``'s device, reporting stage ``lora``."""
    device = best_device(ctx.device)
    out: list[ModuleFactors] = []
    for i, (name, delta) in enumerate(deltas):
        if ctx.cancelled():
            raise Cancelled("LoRA export cancelled")
        a, b, energy = low_rank_factors(delta.to(device), rank)
        out.append(ModuleFactors(_module(name), a.cpu(), b.cpu(), energy))
        ctx.report("lora", i + 1, total)
    return out


def _merge_deltas(merged: ModelFolder, base: ModelFolder, names: list[str]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """``merged - base`` for each name, one tensor at a time (float32, CPU)."""
    with TensorReader() as reader:
        for name in names:
            yield name, (reader.read(merged.tensors[name]).to(torch.float32)
                         - reader.read(base.tensors[name]).to(torch.float32))


def _untargeted_changes(merged: ModelFolder, base: ModelFolder, targets: set[str]
                        ) -> list[str]:
    """Tensors outside the adapter that the merge changed: an adapter cannot carry them,
    so the report names them."""
    changed = []
    with TensorReader() as reader:
        for name, info in merged.tensors.items():
            other = base.tensors.get(name)
            if name in targets or other is None:
                continue
            if not torch.equal(reader.read(info), reader.read(other)):
                changed.append(name)
    return changed


def _adapter_dtype(recipe: Recipe | None) -> torch.dtype:
    from maec_core.runtime import torch_dtype

    name = recipe.output_dtype if recipe is not None else None
    return torch_dtype(name) if name else torch.float32


def publish(staged: StagedOutput, report: dict[str, Any], recipe: Recipe | None,
             merged_manifest: dict[str, Any], names: Mapping[str, str] | None = None
             ) -> dict[str, Any]:
    """The report and the recipe; returns the manifest listing them all (written by the
    caller, last), with the merge's inputs and the accounting of their tensors (into the
    merged tensors the adapter approximates)."""
    inputs: dict[str, Any] = merged_manifest.get("inputs", {})
    extra: dict[str, Any] = {"output_format": "lora"}
    if "accounting" in merged_manifest:
        extra["accounting"] = merged_manifest["accounting"]
    staged.write_json(REPORT_NAME, report)
    recipe_doc: dict[str, Any] = {}
    if recipe is not None:
        # Recorded with the run's references, not the local copies it read (a job's
        # are the worker's own paths).
        recipe = Recipe.model_validate(renamed(
            recipe.model_dump(mode="json", exclude_none=True), names or {}))
        recipe_doc = recipe.model_dump(mode="json", exclude_none=True)
        staged.write_bytes("recipe.yaml", recipe.to_yaml().encode())
    return build_manifest(staged.files, inputs=inputs, recipe=recipe_doc, extra=extra,
                          names=names)


def export_merge(recipe: Recipe, out: Path, ctx: RunContext,
                 merge: Callable[[Path], MergeResult]) -> MergeResult:
    """Run ``merge`` into a temporary folder beside ``out``, then publish at ``out`` the
    adapter approximating its change to ``recipe.lora_base``; the temporary folder is
    removed whatever happens. Of ``ctx`` the progress, cancel, device and overwrite
    apply to the adapter (``merge`` runs as it was made to)."""
    overwrite = ctx.overwrite
    spec = recipe.output or OutputFormat()
    assert spec.format == "lora" and spec.rank is not None and recipe.lora_base is not None
    out = Path(out)
    if out.exists() and not overwrite:
        # Checked before the merge, not after minutes of it.
        raise OutputExists(f"output folder {out} already exists", path=str(out))
    full = out.parent / f".{out.name}.full-{uuid.uuid4().hex[:12]}"
    try:
        merged_result = merge(full)
        started = time.perf_counter()
        merged = open_model_folder(full)
        base = open_model_folder(recipe.lora_base, base=recipe.base_model, config_base=True)
        names = select_targets(((n, t.shape) for n, t in merged.tensors.items()),
                               spec.target_modules)
        with StagedOutput(out, overwrite=overwrite) as staged:
            factors = factor_all(_merge_deltas(merged, base, names), len(names), spec.rank,
                                  ctx)
            lora_base = (ctx.names or {}).get(recipe.lora_base, recipe.lora_base)
            report = write_adapter(staged, factors, spec.rank, lora_base,
                                   base.config, _adapter_dtype(recipe))
            report["untargeted_changed"] = _untargeted_changes(merged, base, set(names))
            manifest = publish(staged, report, recipe, merged_result.manifest, ctx.names)
            if ctx.manifest_file:
                write_manifest(staged.folder, manifest)
            staged.commit()
    finally:
        shutil.rmtree(full, ignore_errors=True)
    seconds = time.perf_counter() - started
    summary = {k: v for k, v in report.items() if k != "modules"}
    summary["modules"] = len(factors)
    stages = {**merged_result.stage_seconds, "lora": seconds}
    return MergeResult(out, manifest, len(factors), merged_result.seconds + seconds, stages,
                       {**(merged_result.report or {}), "lora": summary})
