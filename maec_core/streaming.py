"""The element-wise stream's loop: units of the inputs in, computed on worker threads,
handed to the writer in order, every buffer recycled.

The engine runs it with torch's arithmetic (``maec_core.engine``), and
``maec_core.kernel_merge`` with a compiled kernel alone; it holds bytes (numpy arrays),
so neither pays for the other's imports.
"""

from __future__ import annotations

import collections
import functools
import queue
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from maec_core.io.headers import DTYPE_SIZES
from maec_core.io.units import Unit
from maec_core.io.writer import BackgroundWriter
from maec_core.plan import PlannedTensor
from maec_core.runtime import as_helper_thread

__all__ = ["CHUNK_CPU", "COMPUTE_THREADS", "UNIT_CPU", "WRITE_DEPTH", "WorkFn", "in_flight",
           "output_buffers", "stream_units"]

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


def in_flight(workers: int) -> int:
    """Units computed ahead of the oldest: two per worker, so a worker finds its next
    unit queued even when the calling thread is slow to be scheduled on a busy machine."""
    return 2 * workers if workers > 1 else 1


def output_buffers(count: int, nbytes: int) -> queue.Queue[np.ndarray]:
    """``count`` output buffers of ``nbytes`` each, allocated once per merge."""
    free: queue.Queue[np.ndarray] = queue.Queue()
    for _ in range(count):
        free.put(np.empty(max(1, nbytes), dtype=np.uint8))
    return free


def stream_units(units: Iterable[Unit], tensors: Sequence[PlannedTensor],
                 writer: BackgroundWriter, dtype: str, out_free: queue.Queue[np.ndarray],
                 workers: int, work: WorkFn, tick: Callable[[int], None]) -> None:
    """Compute every unit of ``units`` (of the planned ``tensors``, by step) with ``work``
    into a buffer of ``out_free`` and hand the results to ``writer`` (stored as ``dtype``,
    a safetensors name) in order, whatever order the ``workers`` finish in;
    ``tick(step)`` as each tensor starts."""
    itemsize = DTYPE_SIZES[dtype]
    ahead = in_flight(workers)
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
        writer.put(planned.name, planned.shape, dtype,
                   buf[: (u.hi - u.lo) * itemsize].data, first=u.first, last=u.last,
                   done=functools.partial(out_free.put, buf))

    try:
        for u in units:
            planned = tensors[u.step]
            if u.first:
                tick(u.step)
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
