"""The element-wise stream's loop: units of the inputs read in, computed on worker
threads, handed to the writer in order, every buffer recycled.

The engine runs it with torch's arithmetic (``maec_core.engine``), and
``maec_core.kernel_merge`` with a compiled kernel alone; it holds bytes (numpy arrays),
so neither pays for the other's imports.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import queue
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from maec_core import native
from maec_core.io.headers import DTYPE_SIZES, TensorInfo
from maec_core.io.units import Unit, UnitReader
from maec_core.io.writer import BackgroundWriter
from maec_core.plan import PlannedTensor
from maec_core.runtime import as_helper_thread

if TYPE_CHECKING:
    from maec_core.io.resident import ResidentFiles

__all__ = ["CHUNK_CPU", "COMPUTE_THREADS", "UNIT_CPU", "WRITE_DEPTH", "UnitStream", "WorkFn",
           "stream_units"]

# Elements per read/write unit and per compute slice. A slice of 256K float32 (1 MB per
# input) keeps a method's few passes inside the CPU cache; units of 4M elements keep
# syscalls and thread hand-offs rare.
UNIT_CPU = 1 << 22
CHUNK_CPU = 1 << 18
# CPU threads computing element-wise slices side by side (the registered methods are
# pure functions, safe to run concurrently).
COMPUTE_THREADS = 2
# Output parts queued for the writer thread.
WRITE_DEPTH = 4

# Computes a unit into the start of an output buffer (bytes of the output dtype); on a
# worker thread when there are several.
WorkFn = Callable[[PlannedTensor, Unit, np.ndarray], None]


@dataclasses.dataclass(frozen=True)
class UnitStream:
    """One element-wise stream: the planned ``tensors`` and each one's stored inputs
    (``steps``), the ``writer`` they go to, stored as ``dtype`` (a safetensors name),
    ``tick(step)`` called as each tensor starts, and the input files held in memory
    (``resident``)."""

    tensors: Sequence[PlannedTensor]
    steps: list[list[TensorInfo]]
    writer: BackgroundWriter
    dtype: str
    tick: Callable[[int], None]
    resident: ResidentFiles | None = None


def in_flight(workers: int) -> int:
    """Units computed ahead of the oldest: two per worker, so a worker finds its next
    unit queued even when the calling thread is slow to be scheduled on a busy machine."""
    return 2 * workers if workers > 1 else 1


def stream_units(stream: UnitStream, work: WorkFn, unit: int, workers: int) -> None:
    """Read every tensor of ``stream`` in units of ``unit`` entries (mapped where the
    files are cached), compute each with ``work`` into a recycled output buffer (on
    ``workers`` threads when more than one) and hand the results to the writer in order,
    whatever order the workers finish in."""
    itemsize = DTYPE_SIZES[stream.dtype]
    ahead = in_flight(workers)
    biggest = max((t.numel for t in stream.tensors), default=0)
    # Buffers for the units queued for the writer, the one it writes, and those in flight.
    out_free: queue.Queue[np.ndarray] = queue.Queue()
    for _ in range(WRITE_DEPTH + 1 + ahead):
        out_free.put(np.empty(max(1, min(unit, biggest) * itemsize), dtype=np.uint8))
    # Units in flight, oldest first.
    pending: collections.deque[tuple[PlannedTensor, Unit, np.ndarray, Future[None]]] = (
        collections.deque())
    pool = (ThreadPoolExecutor(max_workers=workers, thread_name_prefix="maec-compute",
                               initializer=as_helper_thread)
            if workers > 1 else None)

    def flush_oldest() -> None:
        planned, u, buf, fut = pending.popleft()
        fut.result()
        u.release()
        stream.writer.put(planned.name, planned.shape, stream.dtype,
                          buf[: (u.hi - u.lo) * itemsize].data, first=u.first, last=u.last,
                          done=functools.partial(out_free.put, buf))

    try:
        with UnitReader(stream.steps, unit, depth=ahead + 1, resident=stream.resident,
                        windows=native.mapped_windows()) as units:
            for u in units:
                planned = stream.tensors[u.step]
                if u.first:
                    stream.tick(u.step)
                buf = out_free.get()
                if pool is None:
                    fut: Future[None] = Future()
                    work(planned, u, buf)
                    fut.set_result(None)
                else:
                    fut = pool.submit(work, planned, u, buf)
                pending.append((planned, u, buf, fut))
                while len(pending) >= ahead:
                    flush_oldest()
            while pending:
                flush_oldest()
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
