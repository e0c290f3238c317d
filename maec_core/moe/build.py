"""Build a mixture of experts from dense checkpoints: the ``mergekit-moe`` counterpart.

Headers are checked and the output planned first (:mod:`maec_core.moe.plan`), then the
router rows are computed (:mod:`maec_core.moe.gates`), and only then is the output
written, one tensor at a time: each piece of an output tensor (an expert's MLP matrix)
is read, scaled or noised as its expert asks, cast and appended to the shard, so memory
holds one input tensor, never a model (the ``hidden`` gate mode excepted: like
mergekit-moe it runs the base model on the prompts, in bfloat16, before writing starts).
The folder is staged and renamed into place complete, its manifest written last; a
failure or cancellation leaves nothing at the output path.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from maec_core.accounting import Accounting
from maec_core.checksums import BackgroundHasher
from maec_core.context import RunContext
from maec_core.errors import Cancelled, MaecError, NonFiniteOutput, OutputExists
from maec_core.io.folder import ModelFolder, open_model_folder
from maec_core.io.output import StagedOutput
from maec_core.io.reader import TensorReader
from maec_core.io.writer import OutputTensor, ShardedWriter, tensor_bytes
from maec_core.manifest import MANIFEST_NAME, build_manifest
from maec_core.moe.config import MoeConfig
from maec_core.moe.gates import gate_vectors
from maec_core.moe.hf_config import output_config_json
from maec_core.moe.layout import MoeTensor, Piece
from maec_core.moe.plan import MoePlan, moe_accounting, plan_moe
from maec_core.naming import renamed
from maec_core.runtime import MergeResult, torch_dtype

__all__ = ["build_moe", "open_sources"]

CONFIG_NAME = "moe_config.yaml"
STAGE = "moe"


def open_sources(config: MoeConfig) -> dict[str, ModelFolder]:
    """Every checkpoint the config names, validated (headers and configs only)."""
    return {ref: open_model_folder(ref) for ref in config.sources()}


def _finite(t: torch.Tensor) -> bool:
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


class _Pieces:
    """Reads pieces and forms them as the output wants: noise, residual scale, cast."""

    def __init__(self, reader: TensorReader, config: MoeConfig, out: torch.dtype) -> None:
        self.reader = reader
        self.out = out
        self.noise = torch.Generator().manual_seed(config.random_seed)

    def form(self, piece: Piece, name: str) -> torch.Tensor:
        t = self.reader.read(piece.source)
        e = piece.expert
        # In the stored dtype, then cast: mergekit's order, so its bits.
        if e is not None and e.noise_scale is not None:
            t = t + torch.randn(t.shape, generator=self.noise, dtype=t.dtype) * e.noise_scale
        if e is not None and piece.residual and e.residual_scale is not None:
            t = t * e.residual_scale
        t = t.to(self.out)
        if not _finite(t):
            raise NonFiniteOutput(f"{name}: a NaN or inf in {piece.source.name} of "
                                  f"{piece.source.file.parent.name}", tensor=name)
        return t


def _write_tensors(plan: MoePlan, config: MoeConfig, writer: ShardedWriter,
                   gates: torch.Tensor, ctx: RunContext) -> None:
    out = torch_dtype(plan.out_dtype)
    experts = len(config.experts)
    total = len(plan.tensors)
    with TensorReader() as reader:
        pieces = _Pieces(reader, config, out)
        for i, t in enumerate(plan.tensors):
            if ctx.cancelled():
                raise Cancelled("MoE build cancelled")
            writer.begin(t.name, t.shape, t.dtype)
            for part in _parts(t, pieces, gates, experts, out):
                writer.append(tensor_bytes(part))
                del part
            writer.end()
            ctx.report(STAGE, i + 1, total)


def _parts(t: MoeTensor, pieces: _Pieces, gates: torch.Tensor, experts: int,
           out: torch.dtype) -> Any:
    if t.zeros:
        yield torch.zeros(t.shape, dtype=out)
    elif t.gate is not None:
        layer, shared = t.gate
        rows = (gates[layer, experts:, :] if shared else gates[layer, :experts, :]).to(out)
        if not _finite(rows):
            raise NonFiniteOutput(f"{t.name}: the router rows hold a NaN or inf (the "
                                  "base's hidden states or embeddings on the prompts)",
                                  tensor=t.name)
        yield rows.contiguous()
    else:
        for piece in t.pieces:
            yield pieces.form(piece, t.name)


def _card(config: MoeConfig, plan: MoePlan) -> str:
    import yaml

    front = {"base_model": config.sources(), "library_name": "transformers",
             "tags": ["moe", "merge", "maec-service", plan.arch]}
    lines = ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "",
             f"# {config.name or 'Mixture of experts'}", "",
             f"A {plan.arch} mixture of {len(config.experts)} experts "
             f"({config.experts_per_token} per token, gate mode `{config.gate_mode}`) "
             f"built from dense checkpoints by the MAEC merge service.", ""]
    if plan.warnings:
        lines += ["## Warnings", "", *(f"- {w}" for w in plan.warnings), ""]
    lines += ["## Config", "", "```yaml", config.to_yaml().rstrip(), "```", "",
              "`manifest.json` lists every file with its size and sha256.", ""]
    return "\n".join(lines)


def build_moe(config: MoeConfig, out: Path, ctx: RunContext | None = None, *,
              folders: dict[str, ModelFolder] | None = None) -> MergeResult:
    """Build the MoE ``config`` describes into the folder ``out`` (complete, or nothing).

    ``config`` is a checked :class:`~maec_core.moe.config.MoeConfig` (parse it with
    :func:`~maec_core.moe.config.parse_moe_config`). From ``ctx``: progress (stage
    ``moe``, one step per output tensor), cancellation (between tensors), ``overwrite``,
    the input-digest cache, and of the engine options only the shard callbacks
    (``on_shard``, ``on_shard_open``: how the worker uploads shards while the build goes
    on). The device does not apply: the router rows are computed on the CPU, in
    mergekit-moe's dtypes, and the rest is copying. ``folders``: the sources already
    opened (else opened here). The result's ``report`` holds the architecture, dtype and
    every warning (ignored keys among them).
    """
    ctx = ctx or RunContext()
    options = ctx.options
    started = time.monotonic()
    if options.sink is not None or options.resident is not None:
        raise MaecError("an MoE build writes a folder: a sink or resident inputs do not "
                        "apply to it")
    if Path(out).exists() and not ctx.overwrite:
        # Said before the prompts run (StagedOutput checks again when it stages).
        raise OutputExists(f"output folder {out} already exists", path=str(out))
    folders = folders if folders is not None else open_sources(config)
    plan = plan_moe(config, folders)
    # Before the prompts run and anything is written: a tensor the plan would drop fails
    # the build here.
    accounting = moe_accounting(config, folders, plan)
    base = folders[config.base_model]
    gates = gate_vectors(config, base, plan.num_layers, plan.hidden_size)
    gated = time.monotonic()
    outputs = [OutputTensor(t.name, t.shape, t.dtype) for t in plan.tensors]
    hasher = BackgroundHasher({ref: f.weight_files for ref, f in folders.items()},
                              cache=ctx.hash_cache)
    with StagedOutput(Path(out), overwrite=ctx.overwrite) as staged:
        writer = ShardedWriter(staged.folder, outputs, config.shard_size_bytes(),
                               on_shard=options.on_shard, on_shard_open=options.on_shard_open)
        try:
            _write_tensors(plan, config, writer, gates, ctx)
            staged.add(writer.close())
        except BaseException:
            writer.abort()
            hasher.stop()
            raise
        manifest = _finish(staged, config, plan, folders, hasher, accounting,
                           names=ctx.names)
        if ctx.manifest_file:
            # Last: the manifest lists the others.
            (staged.folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2,
                                                                  sort_keys=True) + "\n")
        staged.commit()
    done = time.monotonic()
    return MergeResult(Path(out), manifest, len(outputs), done - started,
                       {"gates": gated - started, "write": done - gated},
                       renamed(_report(config, plan), ctx.names))


def _report(config: MoeConfig, plan: MoePlan) -> dict[str, Any]:
    return {"architecture": plan.arch, "dtype": plan.out_dtype,
            "experts": len(config.experts),
            "shared_experts": len(config.shared_experts or []),
            "gate_mode": config.gate_mode, "warnings": plan.warnings}


def _finish(staged: StagedOutput, config: MoeConfig, plan: MoePlan,
            folders: dict[str, ModelFolder], hasher: BackgroundHasher,
            accounting: Accounting, names: Mapping[str, str]) -> dict[str, Any]:
    """The files beside the weights; returns the manifest listing them (written by the
    caller, last). The config and the card name each source as ``names`` says (a job's
    local copies by their references: ``RunContext.names``)."""
    base = folders[config.base_model]
    try:
        staged.copy_side_files(base)
        staged.write_bytes("config.json", output_config_json(plan, config, base))
    except BaseException:
        hasher.stop()
        raise
    shown = config.with_sources(names)
    staged.write_bytes(CONFIG_NAME, shown.to_yaml().encode())
    staged.write_bytes("README.md", _card(shown, plan).encode())
    digests = hasher.result()
    inputs = {ref: {"path": str(f.root), "files": digests.get(ref, {})}
              for ref, f in folders.items()}
    manifest = build_manifest(staged.files, inputs=inputs,
                              recipe=config.model_dump(mode="json", exclude_none=True),
                              extra={"moe": _report(config, plan)}, accounting=accounting,
                              names=names)
    return manifest
