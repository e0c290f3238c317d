"""Read single tensors from validated safetensors files.

We read with ``readinto`` into a fresh buffer rather than memory-mapping whole files:
mapped pages that have been touched count towards the process's resident set until
unmapped, so an mmap reader's peak RSS grows with model size (that is most of mergekit's
footprint). A plain read holds exactly the tensors in hand. The one exception is the
streaming reader's large units, which may be windows mapped one unit at a time and
unmapped once used (``maec_core.io.units``). ``TensorReader`` reads whole tensors
into fresh buffers (the whole-tensor path); ``maec_core.io.units.UnitReader`` streams
runs of elements into a few buffers recycled for the whole merge (the element-wise
path). For a CUDA merge both read into pinned (page-locked) host memory, so host->device
copies run asynchronously (``non_blocking=True``) instead of through a staging copy.

Given :class:`~maec_core.io.resident.ResidentFiles`, every reader takes the bytes of a
held file's tensors from memory instead of the file (the same bytes; a sweep holds its
language base so it is read once for all candidates).
"""

from __future__ import annotations

import io
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from maec_core.errors import CorruptCheckpoint
from maec_core.io.headers import TensorInfo
from maec_core.io.lowrank import with_delta

if TYPE_CHECKING:
    from maec_core.io.resident import ResidentFiles

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
SAFETENSORS_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


class TensorReader:
    """Reads tensors by ``TensorInfo``; keeps one open handle per file.

    Thread-safe: a seek and read pair runs under a per-file lock, so a prefetch thread
    and the main thread can share one reader. ``pin=True`` reads into pinned memory (for
    a CUDA merge; torch's host allocator caches those blocks, so this is no slower per
    tensor once warm). ``resident``: files whose tensors are copied from memory.
    """

    def __init__(self, *, pin: bool = False, resident: ResidentFiles | None = None) -> None:
        self._pin = pin
        self._resident = resident
        self._files: dict[Path, io.BufferedReader] = {}
        self._locks: dict[Path, threading.Lock] = {}
        self._guard = threading.Lock()

    def _handle(self, path: Path) -> tuple[io.BufferedReader, threading.Lock]:
        with self._guard:
            if path not in self._files:
                self._files[path] = open(path, "rb")  # noqa: SIM115 - closed in close()
                self._locks[path] = threading.Lock()
            return self._files[path], self._locks[path]

    def read(self, info: TensorInfo) -> torch.Tensor:
        """The tensor in its stored dtype, on CPU (plus its low-rank delta, if any)."""
        stored = self._read_stored(info)
        return stored if info.delta is None else with_delta(info, stored, self._read_stored)

    def _read_stored(self, info: TensorInfo) -> torch.Tensor:
        buf = torch.empty(info.nbytes, dtype=torch.uint8, pin_memory=self._pin)
        held = self._resident.span(info) if self._resident is not None else None
        if held is not None:
            # A copy, as a read gives: the caller may change its tensor in place.
            buf.copy_(held)
            return buf.view(TORCH_DTYPES[info.dtype]).reshape(info.shape)
        f, lock = self._handle(info.file)
        with lock:
            f.seek(info.start)
            got = f.readinto(buf.numpy().data)
        if got != info.nbytes:
            raise CorruptCheckpoint(
                f"{info.file.name}: tensor {info.name!r} truncated "
                f"({got} of {info.nbytes} bytes)",
                file=info.file.name,
                tensor=info.name,
            )
        return buf.view(TORCH_DTYPES[info.dtype]).reshape(info.shape)

    def close(self) -> None:
        with self._guard:
            for f in self._files.values():
                f.close()
            self._files.clear()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Prefetcher:
    """Reads the next step's tensors on a background thread while the current one computes.

    ``readinto`` releases the GIL, so I/O overlaps torch math. Depth 1 keeps memory at
    two steps' worth of inputs.
    """

    def __init__(self, reader: TensorReader, steps: list[list[TensorInfo]]) -> None:
        self._reader = reader
        self._steps = steps
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="maec-read")
        self._next: Future[list[torch.Tensor]] | None = None
        self._i = 0

    def _load(self, infos: list[TensorInfo]) -> list[torch.Tensor]:
        return [self._reader.read(i) for i in infos]

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> list[torch.Tensor]:
        if self._i >= len(self._steps):
            self.close()
            raise StopIteration
        fut = self._next or self._pool.submit(self._load, self._steps[self._i])
        self._i += 1
        self._next = (
            self._pool.submit(self._load, self._steps[self._i])
            if self._i < len(self._steps)
            else None
        )
        return fut.result()

    def close(self) -> None:
        if self._next is not None:
            self._next.cancel()
        self._pool.shutdown(wait=True)
