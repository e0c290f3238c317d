"""Compiled helpers for the CPU's hottest loops, loaded with ctypes when built.

``l1rows.c`` computes MAEC's row scores (the L1 norm of each row of θA − θ0) bit for bit
as torch does, several times faster (see the file's comment for how and why).
``deltas.c`` runs task arithmetic on a streamed slice in one pass, with the roundings of
torch's step-by-step 16-bit or float32 ops (the engine's element-wise hot path).
``mapped.c`` maps windows of input files read-only for the streaming reader, guarded
against a file that shrinks while mapped (``WindowSource`` in maec_core.io.units). They
are one plain shared library, not a Python extension: ``python -m maec_core.native``
(run by ``make setup`` and the worker image's build) compiles it with the system C
compiler next to this file, named by the sources' and flags' digest so that a stale
build is never loaded.

Nothing depends on it: without a compiler, or with ``MAEC_NATIVE=0``, :func:`l1_rows`
and :func:`task_arithmetic` answer None and callers use torch, with identical results.
``MAEC_NATIVE_AVX512=0`` keeps task arithmetic on its AVX2 loops where the CPU has
AVX-512 (the same results; a check of the wider loops against them).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import mmap
import os
import shlex
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

SOURCE = Path(__file__).with_name("l1rows.c")
SOURCES = (SOURCE, SOURCE.with_name("deltas.c"), SOURCE.with_name("mapped.c"))
# -O2 and no -march: the AVX2 and AVX-512 paths are chosen at run time, so one build serves
# any x86-64 CPU (the image may be built on another machine than it runs on). No floating-point
# contraction: torch rounds a multiply before the add that follows it.
CFLAGS = ("-O2", "-fPIC", "-shared", "-ffp-contract=off")
# The kernel's dtype codes (the enum in l1rows.c), by dtype name. Nothing here imports
# torch at load: the kernels take addresses, so a merge that needs torch for nothing else
# (``maec_core.kernel_merge``) never pays its import.
_DTYPES = {"float32": 0, "bfloat16": 1, "float16": 2}


def library_path() -> Path:
    h = hashlib.sha256(" ".join(CFLAGS).encode())
    for src in SOURCES:
        h.update(src.read_bytes())
    digest = h.hexdigest()[:12]
    return SOURCE.with_name(f"_l1rows-{digest}.so")


def build(cc: str | None = None) -> Path:
    """Compile the library (atomically: a reader never sees half a file); its path.

    Raises ``OSError`` when there is no compiler or the folder is not writable, and
    ``CalledProcessError`` when the compiler fails.
    """
    target = library_path()
    compiler = shlex.split(cc or os.environ.get("CC") or "cc")
    fd, tmp = tempfile.mkstemp(prefix=".l1rows-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([*compiler, *CFLAGS, "-o", tmp, *map(str, SOURCES), "-lm"],
                       check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    _library.cache_clear()
    _guarded.cache_clear()
    return target


@functools.cache
def _library() -> tuple[ctypes.CDLL, int] | None:
    if os.environ.get("MAEC_NATIVE", "1") == "0":
        return None
    path = library_path()
    if not path.is_file():
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        # Built for another platform (a copied tree): torch serves instead.
        return None
    lib.maec_simd_level.restype = ctypes.c_int
    lib.maec_l1_rows.restype = ctypes.c_int
    lib.maec_l1_rows.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.maec_task_arithmetic.restype = ctypes.c_int
    lib.maec_task_arithmetic.argtypes = [
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int,
        ctypes.c_float, ctypes.c_void_p, ctypes.c_int64]
    lib.maec_linear.restype = ctypes.c_int
    lib.maec_linear.argtypes = [
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.c_void_p,
        ctypes.c_int64]
    lib.maec_map_guard.restype = ctypes.c_int
    lib.maec_map.restype = ctypes.c_void_p
    lib.maec_map.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    lib.maec_unmap.restype = None
    lib.maec_unmap.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.maec_map_faults.restype = ctypes.c_int64
    lib.maec_cached.restype = ctypes.c_int
    lib.maec_cached.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.maec_use_cachestat.restype = None
    lib.maec_use_cachestat.argtypes = [ctypes.c_int]
    # 2 where the CPU has AVX-512 F and BW, 1 with AVX2 and F16C only, 0 with neither.
    level = int(lib.maec_simd_level())
    if os.environ.get("MAEC_NATIVE_AVX512", "1") == "0":
        level = min(level, 1)
    return lib, level


def available() -> bool:
    return _library() is not None


@functools.cache
def _guarded() -> ctypes.CDLL | None:
    loaded = _library()
    return loaded[0] if loaded is not None and loaded[0].maec_map_guard() == 1 else None


def map_window(fd: int, offset: int, length: int) -> int | None:
    """The address of bytes ``[offset, offset + length)`` of ``fd`` mapped read-only
    (``offset`` a multiple of the page size), populated and guarded (mapped.c), or None
    when the library is not loaded, no window is free or a page of the range is not in
    the page cache. Give it back with :func:`unmap_window`."""
    lib = _guarded()
    if lib is None:
        return None
    at = lib.maec_map(fd, offset, length)
    return int(at) if at else None


def cached(fd: int, length: int) -> bool:
    """Whether the first ``length`` bytes of ``fd`` are all in the page cache (False
    where the library is not loaded or the kernel does not say)."""
    lib = _guarded()
    return lib is not None and lib.maec_cached(fd, length) == 1


def unmap_window(at: int, length: int) -> None:
    lib = _guarded()
    if lib is not None:
        lib.maec_unmap(at, length)


def map_faults() -> int:
    """How many reads past the end of a file that shrank while mapped have been answered
    with zeros in this process (0 when no window was ever mapped)."""
    lib = _guarded()
    return 0 if lib is None else int(lib.maec_map_faults())


class _Window:
    """Owns one mapped window; unmaps it when the last tensor viewing it is gone."""

    __slots__ = ("at", "length")

    def __init__(self, at: int, length: int) -> None:
        self.at, self.length = at, length

    def __del__(self) -> None:
        unmap_window(self.at, self.length)


class MappedWindows:
    """Input bytes viewed in place (maec_core.io.units' ``WindowSource``).

    ``view`` gives a read-only uint8 array over the file's own pages, mapped for as long
    as an array (or a tensor made from one) views them; never write to it. ``faults``
    counts reads past the end of a file that shrank under a window (answered with zeros:
    see mapped.c), so the reader can fail the merge before anything computed from them
    is published.
    """

    @staticmethod
    def view(fd: int, offset: int, length: int) -> np.ndarray | None:
        start = offset - offset % mmap.PAGESIZE
        size = offset + length - start
        at = map_window(fd, start, size)
        if at is None:
            return None
        raw = (ctypes.c_uint8 * size).from_address(at)
        # The array holds ``raw`` (its base), ``raw`` holds the window: it is unmapped
        # when the last view of these bytes (a slice, a tensor made from one) is freed.
        raw.__dict__["window"] = _Window(at, size)
        # Not flagged read-only: torch warns on every tensor made from such an array.
        # The pages are mapped read-only, so a write would fault, never change a file.
        return np.frombuffer(memoryview(raw).cast("B"), dtype=np.uint8, count=length,
                             offset=offset - start)

    @staticmethod
    def faults() -> int:
        return map_faults()

    @staticmethod
    def cached(fd: int, length: int) -> bool:
        return cached(fd, length)


def mapped_windows() -> MappedWindows | None:
    """The mapped-window source, or None where the library (or its guard) is missing:
    the reader then reads every unit."""
    return MappedWindows() if _guarded() is not None else None


def l1_rows(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
    """float32 ``vector_norm(x.float() - y.float(), 1, dim=1)`` of two 2-D tensors, bit
    for bit, or None when the library cannot take them (not built, not CPU, dtypes that
    differ or that this CPU's path lacks, a non-contiguous layout)."""
    loaded = _library()
    name = str(x.dtype).removeprefix("torch.")
    if (loaded is None or x.device.type != "cpu" or y.device.type != "cpu"
            or x.dim() != 2 or x.shape != y.shape or x.dtype != y.dtype
            or name not in _DTYPES or not x.is_contiguous() or not y.is_contiguous()):
        return None
    import torch

    lib, simd = loaded
    rows, width = x.shape
    out = torch.empty(rows, dtype=torch.float32)
    # ctypes releases the GIL for the call, so scoring threads run it side by side.
    rc = lib.maec_l1_rows(simd, _DTYPES[name], x.data_ptr(), y.data_ptr(), rows, width,
                          out.data_ptr())
    return out if rc == 0 else None


@dataclasses.dataclass(frozen=True)
class Flat:
    """``numel`` entries of ``dtype`` (float32, bfloat16 or float16) stored one after the
    other at the host address ``ptr``: what the kernels take, from a torch tensor
    (:func:`flat`) or from a buffer of bytes (``maec_core.kernel_merge``) alike."""

    ptr: int
    dtype: str
    numel: int


def flat(t: torch.Tensor) -> Flat | None:
    """``t`` as a :class:`Flat`, or None when the kernels cannot take it (not a flat
    contiguous CPU tensor of a dtype they know)."""
    name = str(t.dtype).removeprefix("torch.")
    if (name not in _DTYPES or t.device.type != "cpu" or t.dim() != 1
            or not t.is_contiguous()):
        return None
    return Flat(t.data_ptr(), name, t.numel())


def _flats(tensors: Sequence[torch.Tensor]) -> list[Flat] | None:
    got = [flat(t) for t in tensors]
    return None if any(f is None for f in got) else [f for f in got if f is not None]


def _alike(inputs: Sequence[Flat], out: Flat, compute: str) -> bool:
    """Whether the kernels take these: inputs of one dtype and all of ``out``'s length,
    and a compute dtype they know."""
    return compute in _DTYPES and all(f.numel == out.numel and f.dtype == inputs[0].dtype
                                      for f in inputs)


@dataclasses.dataclass(frozen=True)
class TaskArithmeticSteps:
    """One task-arithmetic call's compute dtype (its name) and scalars, as torch's path
    holds them: ``weights`` already in the compute dtype; ``divisor`` (None: no
    normalisation) and ``lam`` (None: no scaling) as the float32 operands of the divide
    and the multiply."""

    compute: str
    weights: Sequence[float]
    divisor: float | None
    lam: float | None


def task_arithmetic(base: torch.Tensor, models: Sequence[torch.Tensor],
                    steps: TaskArithmeticSteps, out: torch.Tensor) -> bool | None:
    """:func:`task_arithmetic_flat` of flat CPU tensors; None as there, or when a tensor
    is not one the kernels take."""
    flats = _flats([base, *models, out])
    return None if flats is None else task_arithmetic_flat(flats[0], flats[1:-1], steps,
                                                           flats[-1])


def task_arithmetic_flat(base: Flat, models: Sequence[Flat], steps: TaskArithmeticSteps,
                         out: Flat) -> bool | None:
    """Task arithmetic of ``base`` and ``models`` (one dtype) into ``out``, computed in
    ``steps.compute`` (the inputs rounded to it first), rounded to ``out``'s dtype;
    whether every entry of ``out`` is finite. None when the library cannot take the call
    (not built, other dtypes or lengths, no models or more than 16): ``out`` is then
    untouched and the caller uses torch."""
    loaded = _library()
    if loaded is None or not models or not _alike([base, *models], out, steps.compute):
        return None
    lib, simd = loaded
    pointers = (ctypes.c_void_p * len(models))(*[m.ptr for m in models])
    weights = (ctypes.c_float * len(models))(*steps.weights)
    # ctypes releases the GIL for the call, so compute workers run it side by side.
    rc = lib.maec_task_arithmetic(
        simd, _DTYPES[base.dtype], _DTYPES[steps.compute], _DTYPES[out.dtype], len(models),
        base.ptr, pointers, weights, int(steps.divisor is not None),
        steps.divisor or 0.0, int(steps.lam is not None), 1.0 if steps.lam is None else steps.lam,
        out.ptr, out.numel)
    return None if rc < 0 else rc == 0


def linear(inputs: Sequence[torch.Tensor], weights: Sequence[float], total: float | None,
           compute: torch.dtype, out: torch.Tensor) -> bool | None:
    """``Σ w_i x_i`` accumulated in float32 from +0.0 (``weights`` as float32 values),
    divided by ``total`` unless None, rounded to ``compute`` then to ``out``'s dtype, of
    flat CPU tensors of one dtype (rounded to ``compute`` first) into ``out``; whether
    every entry is finite, or None when the library cannot take the call (at most 17
    inputs), ``out`` untouched."""
    loaded = _library()
    fused = _addcmul_fuses()
    flats = _flats([*inputs, out])
    cname = str(compute).removeprefix("torch.")
    if (loaded is None or fused is None or not inputs or flats is None
            or not _alike(flats[:-1], flats[-1], cname)):
        return None
    lib, simd = loaded
    pointers = (ctypes.c_void_p * len(inputs))(*[f.ptr for f in flats[:-1]])
    held = (ctypes.c_float * len(inputs))(*weights)
    rc = lib.maec_linear(simd, _DTYPES[flats[0].dtype], _DTYPES[cname], _DTYPES[flats[-1].dtype],
                         len(inputs), pointers, held, int(total is not None), total or 0.0,
                         int(fused), flats[-1].ptr, flats[-1].numel)
    return None if rc < 0 else rc == 0


@functools.cache
def _addcmul_fuses() -> bool | None:
    """Whether torch's float32 ``addcmul_`` rounds ``acc + x·w`` once (a fused multiply-add:
    its kernels for this CPU were built with contraction) or twice, on long runs (its
    vector loop) and short ones (its scalar loop) alike; None when the two differ.

    x = 1 + 2⁻⁷ and w = 1 + 2⁻²⁰ multiply to 1 + 2⁻⁷ + 2⁻²⁰ + 2⁻²⁷, whose last term a
    float32 product drops: added to minus the rounded product, fused gives 2⁻²⁷, unfused 0.
    """
    import torch

    x, w = 1 + 2.0**-7, 1 + 2.0**-20
    answers = set()
    for n in (3, 67):
        acc = torch.full((n,), -(x + 2.0**-20), dtype=torch.float32)
        acc.addcmul_(torch.full((n,), x, dtype=torch.bfloat16), torch.tensor(w))
        answers |= {float(v) != 0.0 for v in acc}
    return answers.pop() if len(answers) == 1 else None
