"""A merge computed by a compiled kernel alone: no torch imported, nothing converted.

Most published recipes are element-wise merges (task arithmetic above all) of
checkpoints stored in one 16-bit or float32 dtype. Their every entry is one pass of
``maec_core.native``'s kernels from the stored bytes to the output's bytes, the same
bytes torch's step-by-step ops give. Such a merge needs torch for nothing, and importing
it costs about a second of CPU: a third of a 0.85B merge's wall time on two cores. So
:func:`kernel_merge` runs it with bytes only: the units of the inputs
(``maec_core.io.units``), the kernel of each tensor (:meth:`TensorMethod.kernel`) on
worker threads (``maec_core.streaming``), and the same output folder, manifest and
checks as the engine's (``maec_core.publish``).

It takes a merge only when every part of it has a kernel and nothing needs torch: a
tensor method that is element-wise, with a separate base, every tensor's inputs stored
in one float dtype with no adapter delta, no vocabulary to build, on the CPU, into a
folder of its own (no sink, no held inputs, not one part of a split or resumed merge),
and the library built. Otherwise it answers None and the engine runs the merge.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from maec_core import native, streaming
from maec_core.context import OutputSpec, RunContext
from maec_core.errors import MaecError, non_finite
from maec_core.io.headers import DTYPE_SIZES, FLOAT_DTYPES, TensorInfo
from maec_core.io.units import Unit
from maec_core.io.writer import BackgroundWriter, ShardedWriter, WrittenFile
from maec_core.method_plan import MethodPlan, plan_method
from maec_core.methods import TensorCall, TensorMethod, get_method
from maec_core.methods.base import Kernel
from maec_core.methods.params import layer_index
from maec_core.plan import PlannedTensor
from maec_core.publish import plan_accounting, publish_folder, ticker
from maec_core.recipe import Recipe
from maec_core.runtime import EngineOptions, MergeResult, compute_dtype_for
from maec_core.streaming import UnitStream, stream_units

__all__ = ["kernel_merge"]

# Safetensors names of the dtypes the kernels write, and back.
_STORED = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_NAMES = {v: k for k, v in _STORED.items()}
# A GPU that torch would merge on shows as one of these device nodes (CUDA, ROCm, WSL).
_GPU_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def kernel_merge(recipe: Recipe, out: Path, ctx: RunContext) -> MergeResult | None:
    """Merge ``recipe`` into ``out`` with compiled kernels alone, as the engine would
    (the same files, the same bytes), or None when the merge is not one they take (see
    the module's docstring): nothing is read or written then."""
    spec = get_method(recipe.merge_method)
    if (not isinstance(spec, TensorMethod) or not spec.elementwise or recipe.layered
            or type(spec).kernel is TensorMethod.kernel or not _plain(ctx.options)
            or not _on_cpu(ctx.device) or not native.available()):
        return None
    planned = plan_method(recipe, spec)
    plan = planned.plan
    compute = compute_dtype_for(ctx.options, recipe.dtype, plan.input_dtype,
                                float32_only=spec.float32_only)
    stored = _STORED.get(planned.out_dtype)
    if planned.base_key is None or planned.vocab is not None or stored is None:
        return None
    kernels = _kernels(recipe, spec, planned, compute, planned.out_dtype)
    if kernels is None:
        return None
    started = time.perf_counter()
    accounting = plan_accounting(plan, planned.read)
    total = len(plan.tensors)
    tick = ticker(ctx, "merge", total)
    steps = [planned.read(t) for t in plan.tensors]

    def weights(sink: ShardedWriter) -> list[WrittenFile]:
        writer = BackgroundWriter(sink, depth=streaming.WRITE_DEPTH)
        try:
            _stream(plan.tensors, steps, kernels, writer, stored, tick)
            files = writer.close()
        except BaseException:
            writer.abort()
            raise
        if ctx.progress is not None and total:
            ctx.progress("merge", total, total)
        return files

    output = OutputSpec(out, recipe, planned.out_dtype, planned.reference,
                        list(planned.named.values()),
                        config_dtype=recipe.output_dtype or plan.input_dtype)
    manifest = publish_folder(plan, output, ctx, weights, stored, accounting)
    seconds = time.perf_counter() - started
    return MergeResult(out, manifest, total, seconds, {"merge": seconds})


def _plain(options: EngineOptions) -> bool:
    """A merge into a folder of its own, from whole inputs on disk."""
    return (options.sink is None and options.resident is None and options.done_shards is None
            and options.part is None and options.present is None)


def _on_cpu(requested: str | None) -> bool:
    """Whether the merge runs on the CPU: asked for, or no GPU to choose (torch's answer
    when it is loaded already; else no GPU device node, so nothing torch could use)."""
    if requested is not None:
        return requested == "cpu"
    torch = sys.modules.get("torch")
    if torch is not None:
        return not torch.cuda.is_available()
    return not any(os.path.exists(node) for node in _GPU_NODES)


def _kernels(recipe: Recipe, spec: TensorMethod, planned: MethodPlan, compute: str,
             out_dtype: str) -> dict[str, Kernel] | None:
    """Each planned tensor's kernel, or None when one tensor has none: its inputs not
    one float dtype, one of them formed with an adapter's delta, or the method or the
    library declining it (asked with empty runs, which cost nothing)."""
    entries = spec.merged_entries(recipe)
    num_layers = planned.plan.num_layers
    kernels: dict[str, Kernel] = {}
    for t in planned.plan.tensors:
        infos = planned.read(t)
        dtypes = {i.dtype for i in infos}
        if len(dtypes) != 1 or not dtypes <= FLOAT_DTYPES or any(i.delta for i in infos):
            return None
        model_params, params = spec.resolve_models(recipe, entries, t.name, num_layers)
        kernel = spec.kernel(TensorCall(name=t.name, base=None, models=[],
                                        model_params=model_params, params=params,
                                        layer=layer_index(t.name), num_layers=num_layers),
                             compute)
        dtype = _NAMES[infos[0].dtype]
        if kernel is None or kernel([native.Flat(0, dtype, 0)] * len(infos),
                                    native.Flat(0, out_dtype, 0)) is None:
            return None
        kernels[t.name] = kernel
    return kernels


def _stream(tensors: Sequence[PlannedTensor], steps: list[list[TensorInfo]],
            kernels: dict[str, Kernel], writer: BackgroundWriter, stored: str,
            tick: Callable[[int], None]) -> None:
    """Every unit of every tensor through its kernel, from the inputs' bytes (read, or
    mapped where cached) straight into an output buffer, on the workers, in the engine's
    units and slices; to the writer in order."""
    chunk = streaming.CHUNK_CPU
    itemsize = DTYPE_SIZES[stored]
    out_dtype = _NAMES[stored]

    def work(planned: PlannedTensor, u: Unit, buf: np.ndarray) -> None:
        kernel = kernels[planned.name]
        starts = [d.ctypes.data for d in u.data]
        sizes = [DTYPE_SIZES[t] for t in u.dtypes]
        names = [_NAMES[t] for t in u.dtypes]
        out = buf.ctypes.data
        for c0 in range(0, u.hi - u.lo, chunk):
            n = min(u.hi - u.lo - c0, chunk)
            finite = kernel([native.Flat(at + c0 * size, name, n)
                             for at, size, name in zip(starts, sizes, names, strict=True)],
                            native.Flat(out + c0 * itemsize, out_dtype, n))
            if finite is None:  # it took the same call without entries (_kernels)
                raise MaecError(f"the compiled kernel declined tensor {planned.name!r}")
            if not finite:
                raise non_finite(planned.name)

    stream_units(UnitStream(tensors, steps, writer, stored, tick), work, streaming.UNIT_CPU,
                 streaming.COMPUTE_THREADS)
