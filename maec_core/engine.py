"""The streaming merge engine: plan from headers, then one tensor at a time to disk.

``stream_merge`` is the shared loop (read inputs with prefetch, compute in the merge's
compute dtype on the best device, check finiteness, cast, append to the sharded writer,
report progress, honour cancellation); ``run_method`` drives it for the registered
methods, and the MAEC pipeline reuses it for combination. ``maec_core.run`` chooses
between the two.

Two paths share it. Methods that need a whole tensor (TIES, DARE) get one tensor at a
time, the next one read on a thread meanwhile; a method whose per-tensor reductions can
run over slices (SLERP's norms and dot) streams 16-bit compute after passes that reduce
them (``_reduced``). Element-wise methods (linear, task
arithmetic, layer swapping) stream slices instead: a reader thread fills recycled
buffers, the calling thread converts each slice to the compute dtype (float32, or a
16-bit one: the same loop, see ``stream_merge``), computes and casts it into a recycled
output buffer, and a writer thread hashes and writes it (sha256 and the file write
themselves overlap). Nothing is allocated per tensor, so memory is a few
buffers, and the arithmetic runs in the CPU cache instead of streaming each pass
through RAM (on CPU that path measured 3-6x faster than whole-tensor passes).

On a CUDA device both paths run in ``maec_core.cuda_loops`` instead (pinned reads,
copies on their own stream, one wait per unit or tensor, when the writer needs it).
How a merge runs (compute dtype, GPU budget, a callback per finished shard, a sink
taking the tensors instead of a folder, and the model-definition files it may build
from, input files held in memory) is an ``EngineOptions``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import queue
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from maec_core import native, streaming
from maec_core.context import OutputSpec, RunContext
from maec_core.cuda_loops import (
    ComputeFn,
    LoopRun,
    OffsetComputeFn,
    PatchFn,
    computed,
    stream_units_cuda,
    whole_tensors_cuda,
)
from maec_core.errors import InputRangeMissing, non_finite
from maec_core.io.headers import TensorInfo
from maec_core.io.output import StagedOutput
from maec_core.io.reader import SAFETENSORS_NAMES, Prefetcher, TensorReader
from maec_core.io.units import Unit, UnitReader
from maec_core.io.writer import (
    BackgroundWriter,
    OutputTensor,
    ShardedWriter,
    SinkFn,
    TensorSink,
    WrittenFile,
    shard_layout,
)
from maec_core.method_plan import plan_method
from maec_core.methods import TensorCall, TensorMethod, get_method
from maec_core.methods.base import FirstPass
from maec_core.methods.params import layer_index
from maec_core.plan import MergePlan, PlannedTensor, rows_of
from maec_core.publish import (
    plan_accounting,
    publish_folder,
    ticker,
    write_definition,
)
from maec_core.recipe import Recipe
from maec_core.runtime import (
    EngineOptions,
    MergeResult,
    ThreadControl,
    best_device,
    compute_dtype_for,
    torch_dtype,
    torch_threads,
)
from maec_core.slices import prepare_slices
from maec_core.streaming import UnitStream, stream_units
from maec_core.vocab.build import is_vocab_tensor
from maec_core.vocab.rows import RowAligner

__all__ = ["ComputeFn", "FusedFn", "MergeWork", "OffsetComputeFn", "PatchFn", "Reduction",
           "run_method", "stream_merge"]

# A compiled slice kernel: (tensor, its stored-dtype input slices, the output slice, the
# compute dtype) -> whether the output is finite, or None when it cannot take them.
FusedFn = Callable[[PlannedTensor, list[torch.Tensor], torch.Tensor, torch.dtype],
                   bool | None]

# Whole-tensor merges on CPU use torch's thread team only from this size up.
THREADED_MIN_NUMEL = 1 << 22



def all_finite(t: torch.Tensor) -> bool:
    """Whether every entry of ``t`` is finite.

    torch's min and max propagate NaN, and every other entry lies between them, so both
    extremes are finite exactly when all entries are. One ``aminmax`` pass costs half a
    float32 sum of a bfloat16 slice (the sum converts every entry first) and some 20
    times less than ``torch.isfinite(t).all()`` on CPU; it is on the per-slice path of
    every element-wise merge.
    """
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def _whole_tensors(run: LoopRun) -> None:
    """One tensor at a time: for methods that need the whole tensor (TIES, SLERP, ...)."""
    plan, steps, writer, compute = run.plan, run.steps, run.writer, run.compute
    device, target, tick = run.device, run.target, run.tick
    cdtype = torch_dtype(run.options.compute_dtype or "float32")
    with TensorReader(resident=run.options.resident) as reader, torch_threads() as threads:
        prefetch = Prefetcher(reader, steps)
        try:
            for i, (planned, raw) in enumerate(zip(plan.tensors, prefetch, strict=True)):
                tick(i)
                if device.type == "cpu":
                    # Small tensors on one thread: an OpenMP team costs a barrier per op,
                    # and on a busy machine a descheduled member stalls each one
                    # (TIES on many small tensors measured 30x slower on 2 shared cores).
                    threads.use(threads.saved if planned.numel >= THREADED_MIN_NUMEL else 1)
                inputs = [r.to(device=device, dtype=cdtype) for r in raw]
                del raw
                merged = computed(compute, planned, inputs).to(device="cpu", dtype=target)
                del inputs
                # Checked after the cast: a float32 value beyond float16's range only
                # becomes inf there, and the cast tensor is the smaller one to scan.
                if not all_finite(merged):
                    raise non_finite(planned.name)
                # Fresh tensors per step, so the writer thread may hold this one safely.
                writer.write(planned.name, merged)
                del merged
        finally:
            prefetch.close()


def _elementwise(run: LoopRun, compute_threads: int = 1, fused: FusedFn | None = None
                 ) -> None:
    """Stream fixed-size runs of elements through ``compute``, all buffers recycled.

    Valid only when ``compute`` is element-wise: it then sees flat slices of the inputs
    and its result on a slice equals the slice of its result on the whole tensor. Work
    per slice stays in the CPU cache (a few passes over 1 MB instead of over a 500 MB
    tensor), every buffer is allocated once, and reading, computing and hashing/writing
    run on three threads.
    """
    # One compute thread: the slices are too small to split, and on a busy machine an
    # OpenMP team waiting at a barrier for a descheduled member stalls every op (measured
    # 20x slower on 2 shared cores). Reading and writing run on their own threads.
    with torch_threads(1):
        _stream_units(run, streaming.UNIT_CPU, streaming.CHUNK_CPU, workers=compute_threads,
                      fused=fused)


def _scratch(run: LoopRun, unit: int, chunk: int, workers: int
             ) -> queue.Queue[list[torch.Tensor]]:
    """Per compute worker, one compute-dtype slice per input, allocated once per merge
    and recycled (``_stream_units``)."""
    cdtype = torch_dtype(run.options.compute_dtype or "float32")
    slots = max((len(s) for s in run.steps), default=0)
    scratch: queue.Queue[list[torch.Tensor]] = queue.Queue()
    for _ in range(workers):
        scratch.put([torch.empty(min(chunk, unit), dtype=cdtype, device=run.device)
                     for _ in range(slots)])
    return scratch


def _fused_unit(fused: FusedFn, planned: PlannedTensor, u: Unit, out: torch.Tensor,
                cdtype: torch.dtype, chunk: int) -> bool:
    """Unit ``u`` through the compiled kernel into ``out``, slice by slice (the same
    slices as the torch path; no copies in between); False when it declines the first
    slice (then it declines them all: the call differs only in its offsets)."""
    for c0 in range(0, u.hi - u.lo, chunk):
        c1 = min(u.hi - u.lo, c0 + chunk)
        finite = fused(planned, [t[c0:c1] for t in u.tensors], out[c0:c1], cdtype)
        if finite is None:
            return False
        if not finite:
            raise non_finite(planned.name)
    return True


def _stream_units(run: LoopRun, unit: int, chunk: int, workers: int = 1,
                  fused: FusedFn | None = None) -> None:
    """The element-wise stream (``maec_core.streaming``) with torch's arithmetic: each
    unit through ``fused`` when it takes it, else converted to the compute dtype slice by
    slice, computed and cast into the output buffer."""
    target = run.target
    cdtype = torch_dtype(run.options.compute_dtype or "float32")
    tsize = torch.empty((), dtype=target).element_size()
    scratch = _scratch(run, unit, chunk, workers)

    # stream_merge leaves patch_at only to float32 merges.
    patch_at = run.patch_at

    def work(planned: PlannedTensor, u: Unit, buf: np.ndarray) -> None:
        """Compute unit ``u`` into ``buf`` (on a worker when ``workers`` > 1)."""
        out = torch.from_numpy(buf[: (u.hi - u.lo) * tsize]).view(target)
        if patch_at is not None and len(u.tensors) == 1 and u.tensors[0].dtype == target:
            # The input's bytes are the result but for a few entries: copied as they
            # are (a float32 round trip of them is exact), then patched.
            out.copy_(u.tensors[0])
            patch_at(planned, out, u.lo)
            if not all_finite(out):
                raise non_finite(planned.name)
            return
        if fused is not None and _fused_unit(fused, planned, u, out, cdtype, chunk):
            return
        mine = scratch.get()
        try:
            for c0 in range(0, u.hi - u.lo, chunk):
                c1 = min(u.hi - u.lo, c0 + chunk)
                ins = [s[: c1 - c0].copy_(t[c0:c1])
                       for s, t in zip(mine, u.tensors, strict=False)]
                part = out[c0:c1]
                part.copy_(run.computed(planned, ins, u.lo + c0))
                if not all_finite(part):
                    raise non_finite(planned.name)
        finally:
            scratch.put(mine)

    stream = UnitStream(run.plan.tensors, run.steps, run.writer, SAFETENSORS_NAMES[target],
                        run.tick, run.options.resident)
    stream_units(stream, work, unit, workers)


def check_present(steps: Sequence[Sequence[TensorInfo]],
                  present: Callable[[Path, int, int], bool] | None) -> None:
    """``InputRangeMissing`` unless every stored tensor of ``steps`` lies in bytes the
    caller fetched (``EngineOptions.present``; None: inputs are whole)."""
    if present is None:
        return
    for infos in steps:
        for info in infos:
            if not present(Path(info.file), info.start, info.end):
                raise InputRangeMissing(
                    f"{info.name} (bytes {info.start}-{info.end} of {Path(info.file).name})"
                    " was not fetched: the merge would read bytes it does not hold",
                    tensor=info.name, file=Path(info.file).name)
            if info.delta is not None:
                raise InputRangeMissing(f"{info.name} is formed from an adapter, whose "
                                        "reads are not checked against fetched ranges",
                                        tensor=info.name)


@dataclasses.dataclass(frozen=True)
class Reduction:
    """A method's per-tensor reduction, for streaming 16-bit compute on the CPU.

    ``start(t, compute)`` gives the tensor's first pass (None: ``t`` goes whole to the
    work's ``compute``); after it has seen every slice of ``t``, its ``finish()`` is the
    state ``compute(t, inputs, state)`` merges each slice with (None: whole as well).
    """

    start: Callable[[PlannedTensor, torch.dtype], FirstPass | None]
    compute: Callable[[PlannedTensor, list[torch.Tensor], Any], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class MergeWork:
    """What the engine computes for each planned tensor, and how it may split the work.

    ``read(t)`` names the stored tensors to load for ``t``; ``compute`` receives them as
    float32 on the device and returns the merged float32 tensor. ``stage`` names the
    progress reports.

    ``elementwise=True`` promises that ``compute`` works entry by entry (its inputs may
    then be flat slices of the tensors, and it must not keep or return references that
    outlive the call other than its result): the engine then streams slices instead of
    whole tensors, which is several times faster on CPU and holds a few MB, not a tensor.
    ``compute_at`` (implies ``elementwise``; ``compute`` is then used for whole tensors
    only) is such a function that is also given the flat offset of its slice in the
    tensor. ``compute_threads`` > 1 runs element-wise slices on that many CPU threads at
    once; only for a ``compute`` that is safe to call concurrently. ``whole(t)`` True
    sends ``t`` whole to ``compute`` even in an element-wise merge (its inputs differ in
    rows: a vocabulary remap).

    ``patch_at`` (with ``compute_at``) promises that the result is the one input but for a
    few entries: on CPU, in float32 compute, a slice whose input is stored in the output
    dtype is then copied as it is and ``patch_at`` changes those entries in place, with
    the float32 arithmetic ``compute_at`` would do on them (the same bytes, without
    converting every entry to float32 and back).

    ``fused`` (with ``elementwise``) is a compiled kernel for the CPU stream: it computes
    a unit straight from the stored bytes into the output, the bytes ``compute`` would
    give, or declines (None) and ``compute`` runs.

    ``reduction`` (not with ``elementwise``): a merge that needs a reduction over each
    whole tensor first streams 16-bit compute on the CPU in two passes, the reduction's
    over slices, then the slices' merges (``_reduced``); otherwise whole tensors.

    ``feeds(t)`` names the plan's model keys whose tensor goes into ``t`` (default:
    those ``read(t)`` loads); for the manifest's accounting, when a tensor reaches the
    output by another way than being read here (MAEC's base, through the ability
    vectors). ``added``: output tensors that also take values from outside the plan's
    models (MAEC's stored ability vectors), so the accounting says merged, not copied.
    """

    compute: ComputeFn
    read: Callable[[PlannedTensor], list[TensorInfo]]
    stage: str = "merge"
    elementwise: bool = False
    compute_at: OffsetComputeFn | None = None
    compute_threads: int = 1
    whole: Callable[[PlannedTensor], bool] | None = None
    patch_at: PatchFn | None = None
    fused: FusedFn | None = None
    reduction: Reduction | None = None
    feeds: Callable[[PlannedTensor], Sequence[str]] | None = None
    added: Collection[str] = ()

    @property
    def streams(self) -> bool:
        """Whether the work may stream flat slices (element-wise)."""
        return self.elementwise or self.compute_at is not None


def stream_merge(plan: MergePlan, work: MergeWork, output: OutputSpec, ctx: RunContext
                 ) -> MergeResult:
    """Run ``work`` over every planned tensor and publish a complete output folder
    (``output``), or, with ``ctx.options.sink``, hand the tensors to that sink and write
    no weights: at most the model's definition files, at ``options.skeleton`` when given.

    Nothing appears at ``output.folder`` unless every step succeeds. The input files
    (``output.hash_inputs``, by default every model's weight files) are hashed for the
    manifest on a thread meanwhile, digests kept in the folder ``ctx.hash_cache`` when
    given.
    """
    recipe = output.recipe
    # Resolved once here, so every loop below sees a concrete compute dtype.
    options = dataclasses.replace(ctx.options, compute_dtype=compute_dtype_for(
        ctx.options, recipe.dtype, plan.input_dtype,
        float32_only=get_method(recipe.merge_method).float32_only))
    device = best_device(ctx.device)
    if options.compute_dtype != "float32" and work.streams:
        if device.type == "cuda":
            # On a GPU a 16-bit merge runs whole tensors: its kernels may contract a
            # multiply and an add into one rounding, which only whole-tensor runs have
            # been checked to give the same bytes for.
            work = dataclasses.replace(work, elementwise=False, compute_at=None,
                                       patch_at=None)
        else:
            # On the CPU a 16-bit merge streams slices like a float32 one: torch's CPU
            # ops on 16-bit tensors compute each entry in float32 and round it once, so
            # an element-wise method gives the same bytes however the tensor is cut
            # (tests/core/test_engine.py, and mergekit's bytes in
            # tests/conformance). ``patch_at`` is float32 arithmetic.
            work = dataclasses.replace(work, patch_at=None)
    started = time.perf_counter()
    # From the plan and headers, before anything is written: a tensor the plan would
    # drop fails the merge here instead of vanishing from the output.
    accounting = plan_accounting(plan, work.read, work.feeds, work.added)
    target = torch_dtype(output.dtype)
    total = len(plan.tensors)
    outputs = [OutputTensor(t.name, t.shape, SAFETENSORS_NAMES[target]) for t in plan.tensors]
    loop = _Loop(plan, work, device, target, options,
                 ticker(ctx, work.stage, total))

    def write(sink: TensorSink, background: bool = True) -> list[WrittenFile]:
        files = _write_tensors(sink, background, loop)
        if ctx.progress is not None and total:
            ctx.progress(work.stage, total, total)
        return files

    manifest: dict[str, Any] = {}
    if options.sink is not None:
        _to_sink(write, outputs, options.sink, options.skeleton,
                 functools.partial(write_definition, plan=plan, output=output))
    else:
        manifest = publish_folder(plan, output, ctx, write, SAFETENSORS_NAMES[target],
                                  accounting)
    seconds = time.perf_counter() - started
    return MergeResult(output.folder, manifest, total, seconds, {work.stage: seconds})


@dataclasses.dataclass(frozen=True)
class _Loop:
    """One merge's loop settings, shared by every run of its tensors."""

    plan: MergePlan
    work: MergeWork
    device: torch.device
    target: torch.dtype
    options: EngineOptions
    tick: Callable[[int], None]


def _to_sink(
    write: Callable[[TensorSink, bool], list[WrittenFile]],
    outputs: list[OutputTensor],
    sink: SinkFn,
    skeleton: Path | None,
    define: Callable[[StagedOutput], None],
) -> None:
    """The merge's tensors handed to the caller's ``sink`` as they come: no folder, so
    no manifest and no input digests for one; the model's definition files first
    written to ``skeleton`` when given, complete before the sink is made (it may build
    its model from them)."""
    if skeleton is not None:
        with StagedOutput(skeleton) as staged:
            define(staged)
            staged.commit()
    # On this thread: a sink keeps the tensors in memory, a copy cheaper than handing
    # each part to a writer thread.
    write(sink(outputs), False)


def _write_tensors(sink: TensorSink, background: bool, loop: _Loop) -> list[WrittenFile]:
    """Merge every planned tensor into ``sink`` (a staged folder's shards and their
    index, or the caller's sink; on a thread of its own when ``background``); returns
    the files it wrote."""
    # Resuming, or one part of a split merge: the tensors of the shards not made here are
    # neither read nor computed (the progress count includes them).
    if isinstance(sink, ShardedWriter) and sink.partial:
        loop = _resumed(loop, sink.expected())
    plan, work = loop.plan, loop.work
    writer = BackgroundWriter(
        sink,
        # Whole tensors: one queued while one is written, so memory stays at a couple
        # of tensors; slices are small and recycled, a deeper queue is free.
        depth=0 if not background else streaming.WRITE_DEPTH if work.streams else 1,
    )
    steps = [work.read(t) for t in plan.tensors]
    # Inputs held in part: nothing is read unless all of it was fetched.
    check_present(steps, loop.options.present)
    cuda = loop.device.type == "cuda"
    cdtype = torch_dtype(loop.options.compute_dtype or "float32")
    if work.reduction is not None and not cuda and cdtype.itemsize == 2:
        work = _reduced(work, work.reduction, plan, steps, loop.options, cdtype)
    try:
        for lo, hi, alone in _runs(plan, work.streams, work.whole):
            run = LoopRun(dataclasses.replace(plan, tensors=plan.tensors[lo:hi]),
                          steps[lo:hi], writer, work.compute, work.compute_at, loop.device,
                          loop.target, functools.partial(_shifted, loop.tick, lo),
                          loop.options, work.patch_at)
            if alone and cuda:
                whole_tensors_cuda(run)
            elif alone:
                _whole_tensors(run)
            elif cuda:
                stream_units_cuda(run)
            else:
                _elementwise(run, work.compute_threads, work.fused)
        return writer.close()
    except BaseException:
        writer.abort()
        raise


def _reduced(work: MergeWork, reduction: Reduction, plan: MergePlan,
             steps: list[list[TensorInfo]], options: EngineOptions, cdtype: torch.dtype
             ) -> MergeWork:
    """``work`` streaming slices after a first pass over every tensor that takes one:
    the passes read each input in units, so memory stays at a few units (and the
    reductions' small states), never a tensor. A tensor without a pass, or whose pass
    declines, goes whole."""
    states: dict[str, Any] = {}
    passes: dict[int, FirstPass] = {}
    todo = [i for i, t in enumerate(plan.tensors)
            if not (work.whole is not None and work.whole(t))]
    with torch_threads() as threads:
        while todo:
            todo = _pass_round(todo, plan, steps, options, cdtype, reduction,
                               (passes, states, threads))
    whole = work.whole

    def alone(t: PlannedTensor) -> bool:
        return t.name not in states or (whole is not None and whole(t))

    def compute_at(t: PlannedTensor, inputs: list[torch.Tensor], _offset: int
                   ) -> torch.Tensor:
        return reduction.compute(t, inputs, states[t.name])

    return dataclasses.replace(work, compute_at=compute_at, whole=alone)


def _pass_round(todo: list[int], plan: MergePlan, steps: list[list[TensorInfo]],
                options: EngineOptions, cdtype: torch.dtype, reduction: Reduction,
                open_passes: tuple[dict[int, FirstPass], dict[str, Any], ThreadControl]
                ) -> list[int]:
    """One read of the ``todo`` tensors' inputs through their passes (``open_passes``:
    by tensor index, started on the first round; the states of those done, by name;
    torch's threads); the tensors whose pass asks for another round."""
    passes, states, threads = open_passes
    again = []
    with UnitReader([steps[i] for i in todo], streaming.UNIT_CPU, resident=options.resident,
                    windows=native.mapped_windows()) as units:
        for u in units:
            index = todo[u.step]
            planned = plan.tensors[index]
            # torch's own thread count, as mergekit runs: a reduction of over 32K entries
            # is split over the threads, so its bits depend on their number (with one
            # thread, SLERP's 1M-4M-entry tensors came out with other bits than mergekit's).
            threads.use(threads.saved)
            try:
                if u.first and index not in passes:
                    started = reduction.start(planned, cdtype)
                    if started is not None:
                        passes[index] = started
                first = passes.get(index)
                if first is None:
                    continue
                first.add(u.tensors[0], u.tensors[1:])
                if u.last:
                    state = first.finish()
                    if first.again():
                        again.append(index)
                    else:
                        del passes[index]
                        if state is not None:
                            states[planned.name] = state
            finally:
                u.release()
    return again


def _resumed(loop: _Loop, expected: set[str]) -> _Loop:
    """``loop`` over only the ``expected`` tensors, counted after the others."""
    tensors = [t for t in loop.plan.tensors if t.name in expected]
    skipped = len(loop.plan.tensors) - len(tensors)
    return dataclasses.replace(loop, plan=dataclasses.replace(loop.plan, tensors=tensors),
                               tick=functools.partial(_shifted, loop.tick, skipped))


def _shifted(tick: Callable[[int], None], offset: int, i: int) -> None:
    tick(offset + i)


def _runs(
    plan: MergePlan, elementwise: bool, whole: Callable[[PlannedTensor], bool] | None
) -> list[tuple[int, int, bool]]:
    """Consecutive runs ``[lo, hi)`` of tensors and whether each goes whole to compute
    (all of them, unless the merge is element-wise and ``whole`` says otherwise)."""
    runs: list[tuple[int, int, bool]] = []
    for i, t in enumerate(plan.tensors):
        alone = not elementwise or (whole is not None and whole(t))
        if runs and runs[-1][2] == alone:
            runs[-1] = (runs[-1][0], i + 1, alone)
        else:
            runs.append((i, i + 1, alone))
    return runs


def _run_slices(recipe: Recipe, spec: TensorMethod, out_dir: Path, ctx: RunContext
                ) -> MergeResult:
    """A slices recipe: its plan, reads and per-tensor calls come from maec_core.slices."""
    job = prepare_slices(recipe, spec)
    work = MergeWork(job.compute, job.read, elementwise=spec.elementwise,
                     compute_threads=streaming.COMPUTE_THREADS, whole=job.whole)
    output = OutputSpec(out_dir, recipe, job.out_dtype, job.tokenizer_from, job.base_models,
                        config_dtype=job.config_dtype)
    return stream_merge(job.plan, work, output, ctx)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """A plain tensor method's merge planned from the inputs' headers alone: its plan,
    the output's shards (each the output tensors it holds, in order), and each model
    key's reference as the recipe names it."""

    plan: MergePlan
    shards: list[list[OutputTensor]]
    refs: dict[str, str]
    vocab: bool


def plain_shard_plan(recipe: Recipe) -> ShardPlan | None:
    """The shard plan of a merge of ``recipe`` (its inputs local), made by the same
    planning steps as :func:`run_method` (the same tensors, dtype and shard size). None
    where the plan is not a plain tensor method's (slices, MAEC, MoE, a LoRA export)."""
    spec = get_method(recipe.merge_method)
    if (not isinstance(spec, TensorMethod) or recipe.layered
            or (recipe.output is not None and recipe.output.format == "lora")):
        return None
    planned = plan_method(recipe, spec)
    plan = planned.plan
    target = torch_dtype(planned.out_dtype)
    outputs = [OutputTensor(t.name, t.shape, SAFETENSORS_NAMES[target]) for t in plan.tensors]
    return ShardPlan(plan, shard_layout(outputs, recipe.shard_size_bytes()), planned.named,
                     planned.vocab is not None)


def planned_shard_count(recipe: Recipe) -> int | None:
    """How many output shards a merge of ``recipe`` (its inputs local) makes, from the
    inputs' headers alone: what splitting it into parts by shard groups needs to know.
    None where the plan is not a plain tensor method's (slices, MoE, a LoRA export) nor
    one a method splits in phases (MAEC: :meth:`MergeMethod.phased`): such a merge is
    not split."""
    spec = get_method(recipe.merge_method)
    if recipe.output is not None and recipe.output.format == "lora":
        return None
    if not isinstance(spec, TensorMethod):
        phased = spec.phased(recipe)
        return phased.shard_count() if phased is not None else None
    planned = plain_shard_plan(recipe)
    return None if planned is None else len(planned.shards)


def run_method(recipe: Recipe, out_dir: Path, ctx: RunContext | None = None) -> MergeResult:
    """Run one registered (non-MAEC) method of a parsed ``recipe`` into ``out_dir``."""
    ctx = ctx or RunContext()
    spec = get_method(recipe.merge_method, TensorMethod)
    if recipe.layered:
        return _run_slices(recipe, spec, Path(out_dir), ctx)
    fn = spec.merge
    planned = plan_method(recipe, spec)
    plan, base_key, keys, vocab = planned.plan, planned.base_key, planned.keys, planned.vocab
    entries = spec.merged_entries(recipe)
    num_layers = plan.num_layers

    # Parameters resolved once per tensor: element-wise merges call compute per slice.
    # Locked: element-wise slices of two tensors may be computed on two threads at once.
    resolved: dict[str, tuple[list[Any], Any]] = {}
    lock = threading.Lock()

    def params_for(name: str) -> tuple[list[Any], Any]:
        with lock:
            return _params_for(name)

    def _params_for(name: str) -> tuple[list[Any], Any]:
        if name not in resolved:
            if len(resolved) > 8:
                resolved.clear()
            resolved[name] = spec.resolve_models(recipe, entries, name, num_layers)
        return resolved[name]

    aligner = RowAligner(vocab) if rows_of(vocab) is not None and vocab else None

    def call_of(t: PlannedTensor, inputs: Sequence[torch.Tensor], state: Any = None
                ) -> TensorCall:
        model_params, params = params_for(t.name)  # no inputs: a call without tensors
        return TensorCall(name=t.name, base=inputs[0] if base_key and inputs else None,
                          models=inputs[1:] if base_key else inputs,
                          model_params=model_params, params=params,
                          layer=layer_index(t.name), num_layers=num_layers, reduced=state)

    def compute(t: PlannedTensor, inputs: list[torch.Tensor]) -> torch.Tensor:
        if aligner is not None and is_vocab_tensor(t.name):
            aligner.align(keys, inputs)  # in place: the originals are let go one by one
        return fn(call_of(t, inputs))

    def fused(t: PlannedTensor, inputs: list[torch.Tensor], out: torch.Tensor,
              cdtype: torch.dtype) -> bool | None:
        return spec.merge_into(call_of(t, inputs), out, cdtype)

    def start(t: PlannedTensor, cdtype: torch.dtype) -> FirstPass | None:
        return spec.first_pass(call_of(t, []), cdtype)  # it is given the slices

    def reduced(t: PlannedTensor, inputs: list[torch.Tensor], state: Any) -> torch.Tensor:
        return fn(call_of(t, inputs, state))

    overrides = type(spec).merge_into is not TensorMethod.merge_into
    reduces = type(spec).first_pass is not TensorMethod.first_pass
    work = MergeWork(compute, planned.read, elementwise=spec.elementwise,
                     compute_threads=streaming.COMPUTE_THREADS,
                     fused=fused if overrides and spec.elementwise else None,
                     reduction=(Reduction(start, reduced)
                                if reduces and not spec.elementwise and base_key else None),
                     whole=None if aligner is None else lambda t: is_vocab_tensor(t.name))
    output = OutputSpec(Path(out_dir), recipe, planned.out_dtype,
                        vocab.copy_from if vocab else planned.reference,
                        list(planned.named.values()),
                        tokenizer_files=vocab.files if vocab else None,
                        config_dtype=recipe.output_dtype or plan.input_dtype)
    return stream_merge(plan, work, output, ctx)

