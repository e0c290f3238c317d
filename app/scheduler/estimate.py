"""A job's peak host memory, GPU memory and local disk, estimated from the headers the
submission already read (no tensor data), so the job goes to a pool that can hold it.

The model, for ``k`` input checkpoints and the largest output tensor of ``n`` elements
(float32 compute, ``c = 4``):

- host memory: the worker process itself (torch imported, ``BASE_RSS``) plus the merge's
  working set. Element-wise methods stream units of ``2**24`` elements, two in flight
  (``maec_core.runtime.EngineOptions``): ``2 * U * (k*(s+c) + c+s)`` whatever the model's
  size. Whole-tensor methods (TIES, SLERP, MAEC, ...) hold ``(2k+1)*n*c``
  (:func:`maec_core.runtime.whole_tensor_bytes`). A job that evaluates also holds the
  merged model (float32, the worst case); a sweep also holds its language base.
- GPU memory (on a GPU worker): the same working set, capped by the engine's budget
  (``GPU_BUDGET_BYTES``): a tensor over it is computed on the CPU instead.
- disk: every input file (the worker's input cache) plus the output in its dtype, once
  per candidate a sweep publishes, plus a margin for the ability artifacts and staging.
  An MoE build (:func:`estimate_moe`) writes each expert's MLP once per expert that
  names it, however few distinct checkpoints they come from.

Every estimate bounds what the job publishes (tests/api/test_estimates_bound_outputs.py
runs one job of each kind and compares).

Deliberately an upper estimate; the job record keeps it beside the measured peak RSS
(``measured.peak_rss_bytes``) so the model can be checked against real runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from maec_core.service import MergePlan, MoeConfig, MoePlan, Recipe, candidates, get_method

# The engine's figures (maec_core.runtime: GPU_BUDGET_BYTES, whole_tensor_bytes), restated
# because that module reaches torch and the API process must not; a test holds them equal.
GPU_BUDGET_BYTES = 8 << 30


def whole_tensor_bytes(numel: int, inputs: int, compute_itemsize: int) -> int:
    return (2 * inputs + 1) * numel * compute_itemsize


MIB = 1 << 20
# A merge child's resident size before it reads any tensor (torch, transformers' Llama
# module, the worker's own code), measured on the test workers (~400 MiB) and rounded up.
BASE_RSS = 512 * MIB
UNIT = 1 << 24
COMPUTE_ITEMSIZE = 4
ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "float32": 4, "float16": 2, "bfloat16": 2}
# Ability artifacts, staging copies, checksums: a few percent of the inputs.
DISK_MARGIN = 0.1


@dataclass(frozen=True)
class Need:
    """What one job needs of the worker that runs it, in bytes."""

    host_memory_bytes: int
    gpu_memory_bytes: int
    disk_bytes: int
    # Units of work against the owner's fair share (a sweep's candidates).
    cost: int = 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _working_set(recipe: Recipe, plan: MergePlan, k: int) -> int:
    largest = max((t.numel for t in plan.tensors), default=0)
    stored = max((ITEMSIZE.get(t.dtype, 4) for t in plan.tensors), default=4)
    if bool(getattr(get_method(recipe.merge_method), "elementwise", False)):
        per_unit = k * (stored + COMPUTE_ITEMSIZE) + COMPUTE_ITEMSIZE + stored
        return 2 * min(UNIT, largest) * per_unit
    return whole_tensor_bytes(largest, k, COMPUTE_ITEMSIZE)


def _output_bytes(recipe: Recipe, plan: MergePlan) -> int:
    size = ITEMSIZE.get(recipe.dtype or "", 0)
    return sum(t.numel * (size or ITEMSIZE.get(t.dtype, 4)) for t in plan.tensors)


def estimate(recipe: Recipe, plan: MergePlan, sources: Mapping[str, Mapping[str, Any]]
             ) -> Need:
    """The needs of ``recipe`` over ``plan``, its inputs pinned as ``sources``."""
    k = max(1, len(plan.models))
    work = _working_set(recipe, plan, k)
    numel = sum(t.numel for t in plan.tensors)
    count = len(candidates(recipe)) if recipe.sweep is not None else 1
    host = BASE_RSS + work
    if recipe.evaluate or recipe.sweep is not None:
        host += numel * COMPUTE_ITEMSIZE
    if recipe.sweep is not None:
        host += numel * ITEMSIZE.get(plan.input_dtype, 2)
    inputs = sum(int(f.get("size", 0)) for s in sources.values() for f in s.get("files", ()))
    publish_all = recipe.sweep is not None and getattr(recipe.sweep, "publish", "") == "all"
    disk = inputs + _output_bytes(recipe, plan) * (count if publish_all else 1)
    if recipe.output is not None and recipe.output.gguf is not None:
        disk += gguf_output_bytes(numel)
    return Need(host_memory_bytes=int(host),
                gpu_memory_bytes=int(min(work, GPU_BUDGET_BYTES)),
                disk_bytes=int(disk * (1 + DISK_MARGIN)), cost=count)


def gguf_output_bytes(numel: int) -> int:
    """A GGUF copy of the output at its largest (f32): 4 bytes a weight."""
    return numel * 4


def estimate_gguf_job(recipe: Recipe, parameters: Sequence[int],
                      sources: Mapping[str, Mapping[str, Any]]) -> Need:
    """A job with GGUF inputs, from their headers alone (the merge plan needs the
    dequantized folders, which only the worker makes). ``parameters``: each GGUF
    input's count. Host memory: the worker plus dequantizing the largest GGUF
    (``maec_core.gguf.dequantize.memory_bytes``: 5 bytes a parameter) or holding the
    whole model in float32 three times over (two inputs and the result of a
    whole-tensor merge), whichever is more. Disk: the inputs, each GGUF input
    dequantized (float32), the output in float32 and a GGUF copy of it."""
    largest = max(parameters, default=0)
    inputs = sum(int(f.get("size", 0)) for s in sources.values() for f in s.get("files", ()))
    work = max(largest * 5, 3 * largest * COMPUTE_ITEMSIZE)
    if recipe.evaluate or recipe.sweep is not None:
        work += largest * COMPUTE_ITEMSIZE
    count = len(candidates(recipe)) if recipe.sweep is not None else 1
    disk = inputs + sum(parameters) * 4 + largest * 4 * count + gguf_output_bytes(largest)
    return Need(host_memory_bytes=int(BASE_RSS + work),
                gpu_memory_bytes=int(min(work, GPU_BUDGET_BYTES)),
                disk_bytes=int(disk * (1 + DISK_MARGIN)), cost=count)


# Router rows are computed in float32 (maec_core.moe.gates).
GATE_ITEMSIZE = 4
# A safetensors header entry beyond its tensor's name ({"dtype":..,"shape":[..],
# "data_offsets":[..]}), and the small files an MoE build writes beside its weights
# (config.json, README, moe_config.yaml, the manifest) beyond what they repeat of the
# config and the inputs' file lists.
HEADER_ENTRY_BYTES = 128
SIDE_BYTES = 64 << 10


def _moe_output_bytes(plan: MoePlan, config: MoeConfig,
                      base_files: Sequence[Mapping[str, Any]], input_files: int) -> int:
    """What an MoE build writes: every planned tensor in the output dtype (each expert's
    MLP as often as the config names an expert, shared experts too, plus the rest of the
    base), the headers, the base's tokenizer and generation files, and the config-sized
    files beside them (the README and moe_config.yaml each hold the config; the
    manifest lists every input file and output file)."""
    weights = sum(t.numel * ITEMSIZE.get(t.dtype, 4) for t in plan.tensors)
    headers = sum(len(t.name) + HEADER_ENTRY_BYTES for t in plan.tensors)
    side = sum(int(f.get("size", 0)) for f in base_files
               if not str(f.get("name", "")).endswith((".safetensors", ".index.json")))
    text = 3 * len(config.to_yaml().encode()) + 256 * (input_files + len(plan.tensors))
    return weights + headers + side + text + SIDE_BYTES


def _moe_piece_bytes(plan: MoePlan) -> int:
    """Host memory of the largest piece the build forms: its input read whole, a noise
    draw and the noised sum in the input dtype, and its cast to the output dtype. The
    fused expert tensors (every expert's MLP side by side) are streamed to the shard
    piece by piece, so no more than one piece is held however many experts there are."""
    largest = 0
    for t in plan.tensors:
        out = ITEMSIZE.get(t.dtype, 4)
        for piece in t.pieces:
            n = piece.source.numel
            largest = max(largest, 3 * n * ITEMSIZE.get(piece.source.dtype, 4) + n * out)
        if not t.pieces:  # zeros or router rows, made whole in the output dtype
            largest = max(largest, t.numel * max(out, GATE_ITEMSIZE))
    return largest


def estimate_moe(config: MoeConfig, plan: MoePlan,
                 sources: Mapping[str, Mapping[str, Any]]) -> Need:
    """The needs of the MoE build ``plan`` (of ``config``) over its pinned ``sources``.

    Disk: the inputs (each distinct source once: the input cache) plus the output
    (:func:`_moe_output_bytes`), which grows with the number of experts, not with the
    number of distinct input files: sixty-four experts copied from one fine-tune write
    sixty-four copies of its MLPs. Host memory: the worker, the router rows (layers x
    experts and shared experts x hidden, float32), the largest piece being formed or
    twice the largest input file, whichever is more, and for the hidden gate modes the
    base model held while the prompts run. No GPU is used (gates on CPU)."""
    files = {ref: list(s.get("files", ())) for ref, s in sources.items()}
    inputs = sum(int(f.get("size", 0)) for v in files.values() for f in v)
    largest = max((int(f.get("size", 0)) for v in files.values() for f in v), default=0)
    experts = len(config.all_experts())
    gates = plan.num_layers * experts * plan.hidden_size * GATE_ITEMSIZE
    holds_base = config.gate_mode.startswith("hidden")
    base_bytes = sum(int(f.get("size", 0)) for f in files.get(config.base_model, ()))
    host = (BASE_RSS + gates + max(2 * largest, _moe_piece_bytes(plan))
            + (base_bytes if holds_base else 0))
    output = _moe_output_bytes(plan, config, files.get(config.base_model, ()),
                               sum(len(v) for v in files.values()))
    return Need(host_memory_bytes=int(host), gpu_memory_bytes=0,
                disk_bytes=int((inputs + output) * (1 + DISK_MARGIN)))
