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

Deliberately an upper estimate; the job record keeps it beside the measured peak RSS
(``measured.peak_rss_bytes``) so the model can be checked against real runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from maec_core.methods import get_method
from maec_core.plan import MergePlan
from maec_core.recipe import Recipe
from maec_core.sweep.grid import candidates

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
    return Need(host_memory_bytes=int(host),
                gpu_memory_bytes=int(min(work, GPU_BUDGET_BYTES)),
                disk_bytes=int(disk * (1 + DISK_MARGIN)), cost=count)


def estimate_moe(base: str, holds_base: bool, sources: Mapping[str, Mapping[str, Any]]
                 ) -> Need:
    """The needs of an MoE build over its pinned ``sources``: the build streams one input
    tensor at a time (at most a file's size, twice: read and written), and the hidden
    gate modes (``holds_base``) also hold the ``base`` model while the prompts run. The
    output holds at most every input's tensors once; no GPU is used (gates on CPU)."""
    sizes = {ref: [int(f.get("size", 0)) for f in s.get("files", ())]
             for ref, s in sources.items()}
    inputs = sum(sum(v) for v in sizes.values())
    largest = max((n for v in sizes.values() for n in v), default=0)
    host = BASE_RSS + 2 * largest + (sum(sizes.get(base, ())) if holds_base else 0)
    return Need(host_memory_bytes=int(host), gpu_memory_bytes=0,
                disk_bytes=int(2 * inputs * (1 + DISK_MARGIN)))
