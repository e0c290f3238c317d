"""The engine's two loops on a CUDA device: copies, compute and write-back overlapped.

What a GPU needs that the CPU loops do not:

- inputs read into pinned host memory (``pin=True`` readers; a resident input's held
  bytes are copied there, never sent to the GPU whole), so a host->device copy
  is a DMA the GPU runs on its own (``non_blocking=True``) instead of a staged copy;
- those copies issued on a separate CUDA stream, so the copy of the next unit or
  tensor runs while the current one computes on the default stream; the compute
  stream waits for the copy through an event, never through the host;
- results copied back into pinned host buffers, also asynchronously, and the host
  waits (an event's ``synchronize``) only when the writer needs those bytes, one step
  behind, so the GPU is never idle while the host writes;
- the finiteness check done on the GPU as a device flag, read after that same wait
  (``bool()`` of a device tensor per chunk would be a synchronisation per chunk).

Arithmetic is the same as on the CPU (the method's float32 function by default), so for
element-wise methods the bytes are the same; the memory this holds on the GPU is
budgeted in :class:`maec_core.runtime.EngineOptions`.
"""

from __future__ import annotations

import collections
import functools
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from maec_core.errors import non_finite
from maec_core.io.headers import TensorInfo
from maec_core.io.reader import SAFETENSORS_NAMES, Prefetcher, TensorReader
from maec_core.io.units import Unit, UnitReader
from maec_core.io.writer import BackgroundWriter
from maec_core.plan import MergePlan, PlannedTensor
from maec_core.runtime import EngineOptions, torch_dtype, torch_threads, whole_tensor_bytes

ComputeFn = Callable[[PlannedTensor, list[torch.Tensor]], torch.Tensor]
# An element-wise compute also told the flat offset of its slice in the tensor, for
# sparse updates (MAEC adds stored key rows to the language base's slices).
OffsetComputeFn = Callable[[PlannedTensor, list[torch.Tensor], int], torch.Tensor]
# A merge that is its one input with a few entries changed, told a flat slice of the
# output (already holding the input's bytes, in the output dtype) and its offset,
# changes those entries in place (MAEC's key rows on the language base).
PatchFn = Callable[[PlannedTensor, torch.Tensor, int], None]
# Elements per unit on CUDA: big enough that a kernel launch and a copy's fixed cost are
# small beside the transfer (16M bf16 elements: 32 MB per input), small enough that two
# units in flight stay well under a GB (the arithmetic is in EngineOptions).
UNIT_CUDA = 1 << 24
# Units in flight on the GPU: one computing while the next one's inputs copy in.
CUDA_IN_FLIGHT = 2
# Output buffers beyond those in flight, queued for the writer thread.
WRITE_DEPTH = 4


@dataclass(frozen=True)
class LoopRun:
    """What a loop (CPU or CUDA) runs: consecutive planned tensors (``plan``'s), the
    stored tensors each reads (``steps``), the method's compute functions, the writer
    taking the results in plan order, and ``tick(i)`` called as tensor ``i`` starts."""

    plan: MergePlan
    steps: list[list[TensorInfo]]
    writer: BackgroundWriter
    compute: ComputeFn
    compute_at: OffsetComputeFn | None
    device: torch.device
    target: torch.dtype
    tick: Callable[[int], None]
    options: EngineOptions
    patch_at: PatchFn | None = None

    def computed(self, planned: PlannedTensor, inputs: list[torch.Tensor], offset: int
                 ) -> torch.Tensor:
        """The method's result on a flat slice at ``offset`` of ``planned``."""
        if self.compute_at is None:
            return self.compute(planned, inputs)
        return self.compute_at(planned, inputs, offset)


def computed(compute: Callable[..., Any], planned: Any, inputs: list[Any]) -> Any:
    """``compute(planned, inputs)``; a parameter too large for a 16-bit compute dtype
    (torch refuses to convert it) is the same failure as an infinite result."""
    try:
        return compute(planned, inputs)
    except RuntimeError as exc:
        if "without overflow" in str(exc):
            raise non_finite(planned.name) from None
        raise


@dataclass
class _Launched:
    """Work queued on the GPU whose result the host has not waited for yet."""

    planned: PlannedTensor
    host: torch.Tensor  # pinned, filled once ``done`` has completed
    finite: torch.Tensor  # device bool, valid once ``done`` has completed
    done: torch.cuda.Event
    unit: Unit | None = None


class _Streams:
    """The copy stream and the compute (current) stream of one CUDA merge."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.compute = torch.cuda.current_stream(device)

    def upload(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        """Copy pinned host tensors to the device on the copy stream; returns them in
        ``dtype`` on the compute stream, which waits for the copy by an event."""
        with torch.cuda.stream(self.copy):
            raw = [t.to(self.device, non_blocking=True) for t in tensors]
        copied = self.copy.record_event()
        self.compute.wait_event(copied)
        for r in raw:
            # Allocated on the copy stream, used on the compute stream: keeps the
            # caching allocator from reusing the memory before the compute is done.
            r.record_stream(self.compute)
        return [r.to(dtype) for r in raw]

    def download(self, planned: PlannedTensor, merged: torch.Tensor, host: torch.Tensor,
                 unit: Unit | None = None) -> _Launched:
        """Queue the copy of ``merged`` into the pinned ``host`` and its finite flag."""
        finite = torch.isfinite(merged).all()
        host.copy_(merged.reshape(host.shape), non_blocking=True)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(self.compute)
        return _Launched(planned, host, finite, done, unit)


def _wait(job: _Launched) -> None:
    """Block until ``job``'s result is on the host; raise if it is not finite."""
    job.done.synchronize()
    if job.unit is not None:
        # The unit's host buffers were copied before the compute that ``done`` follows.
        job.unit.release()
    if not bool(job.finite):
        raise non_finite(job.planned.name)


def whole_tensors_cuda(run: LoopRun) -> None:
    """One tensor at a time on the GPU; the host writes tensor ``i`` while the GPU
    computes ``i + 1``. A tensor whose working set is over the GPU budget is computed
    on the CPU with the same arithmetic."""
    plan, steps, writer, compute = run.plan, run.steps, run.writer, run.compute
    device, target, tick, options = run.device, run.target, run.tick, run.options
    cdtype = torch_dtype(options.compute_dtype or "float32")
    streams = _Streams(device)
    last: _Launched | None = None

    def flush() -> None:
        nonlocal last
        if last is not None:
            _wait(last)
            writer.write(last.planned.name, last.host)
            last = None

    with TensorReader(pin=True, resident=options.resident) as reader, \
            torch_threads() as threads:
        prefetch = Prefetcher(reader, steps)
        try:
            for i, (planned, raw) in enumerate(zip(plan.tensors, prefetch, strict=True)):
                tick(i)
                need = whole_tensor_bytes(planned.numel, len(raw), cdtype.itemsize)
                if need > options.gpu_budget_bytes:
                    flush()  # in order: the writer takes tensors as planned
                    threads.use(threads.saved)
                    merged = computed(compute, planned, [r.to(cdtype) for r in raw]).to(target)
                    if not bool(torch.isfinite(merged).all()):
                        raise non_finite(planned.name)
                    writer.write(planned.name, merged)
                    continue
                inputs = streams.upload(raw, cdtype)
                del raw
                merged = computed(compute, planned, inputs).to(target)
                del inputs
                host = torch.empty(merged.shape, dtype=target, pin_memory=True)
                launched = streams.download(planned, merged, host)
                del merged
                flush()
                last = launched
            flush()
        finally:
            prefetch.close()


def stream_units_cuda(run: LoopRun) -> None:
    """Element-wise units through the GPU: a unit's inputs copy in on the copy stream
    while the previous one computes; results come back to recycled pinned buffers
    that the writer thread hashes and writes, the host waiting one unit behind."""
    plan, steps, writer, device = run.plan, run.steps, run.writer, run.device
    target, tick, options = run.target, run.tick, run.options
    cdtype = torch_dtype(options.compute_dtype or "float32")
    st_dtype = SAFETENSORS_NAMES[target]
    tsize = torch.empty((), dtype=target).element_size()
    streams = _Streams(device)
    biggest = max((t.numel for t in plan.tensors), default=0)
    out_free: queue.Queue[torch.Tensor] = queue.Queue()
    for _ in range(WRITE_DEPTH + CUDA_IN_FLIGHT):
        out_free.put(torch.empty(max(1, min(UNIT_CUDA, biggest)) * tsize, dtype=torch.uint8,
                                 pin_memory=True))
    pending: collections.deque[tuple[_Launched, torch.Tensor]] = collections.deque()

    def flush_oldest() -> None:
        job, buf = pending.popleft()
        _wait(job)
        assert job.unit is not None
        u = job.unit
        writer.put(job.planned.name, job.planned.shape, st_dtype,
                   buf[: (u.hi - u.lo) * tsize].numpy().data.cast("B"), first=u.first,
                   last=u.last, done=functools.partial(out_free.put, buf))

    with UnitReader(steps, UNIT_CUDA, depth=CUDA_IN_FLIGHT + 1, pin=True,
                    resident=options.resident) as units:
        for u in units:
            planned = plan.tensors[u.step]
            if u.first:
                tick(u.step)
            buf = out_free.get()
            ins = streams.upload(u.tensors, cdtype)
            merged = run.computed(planned, ins, u.lo).to(target)
            del ins
            host = buf[: (u.hi - u.lo) * tsize].view(target)
            pending.append((streams.download(planned, merged, host, u), buf))
            del merged
            while len(pending) >= CUDA_IN_FLIGHT:
                flush_oldest()
        while pending:
            flush_oldest()
