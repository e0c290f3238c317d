"""Stage 1 — extraction: key-neuron masks and R(A) = M ⊙ (θA − θref), streamed to an artifact.

I/O plan (the cost of this stage is reading checkpoints):
- ``granularity: row`` with delta importance (default): θ0 and θA stream through in
  row blocks (a few reused buffer sets; on CPU two threads each read and score whole
  blocks) for the float32 row scores; per tensor the key rows follow, then θA and θref
  (θ0 or θS) are read again on the key rows only, about key_ratio of their bytes.
  ``rank_scope: global`` keeps the row scores (4 bytes per row) across a first pass,
  then reads only key rows.
- ``granularity: element``: θ0 and θA a tensor at a time (prefetched); with
  ``rank_scope: global`` a radix select (``radix.py``) finds the global cut in a pass
  per 16-bit key digit (usually two) without holding the scores.
- ``importance: gradient``: the gradient pass (the model in memory: a GPU job at real
  sizes), then θA and θref read on the key rows only.
Memory is otherwise a few blocks or tensors, whatever the model size.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from maec_core.artifact_store import META_NAME
from maec_core.context import RunContext
from maec_core.errors import Cancelled
from maec_core.io.folder import ModelFolder
from maec_core.io.headers import TensorInfo
from maec_core.io.output import StagedOutput
from maec_core.io.reader import SAFETENSORS_NAMES, Prefetcher, TensorReader
from maec_core.io.writer import OutputTensor, ShardedWriter
from maec_core.maec.artifact import (
    DELTA_SUFFIX,
    INDEX_SUFFIX,
    WEIGHTS_NAME,
    delta_shape,
    index_dtype,
)
from maec_core.maec.combine import Cosine
from maec_core.maec.keys import key_of
from maec_core.maec.params import MaecParams, key_count
from maec_core.maec.radix import GlobalSelection, select_global
from maec_core.maec.rowio import RowReader
from maec_core.maec.select import check_scores, global_top_k, top_k_indices
from maec_core.native import l1_rows as native_l1_rows
from maec_core.plan import PlannedTensor, build_plan
from maec_core.runtime import CancelFn, best_device, cpu_single_thread, torch_dtype

StepFn = Callable[[], None]
# An artifact is one file however large: shards would only add an index to keep in sync.
_ONE_SHARD = 2**62


@dataclass
class ExtractResult:
    folder: Path
    key: str
    metadata: dict[str, Any]
    seconds: float
    # c_t against ``AbilityInputs.language`` per tensor, when one was given: not part of
    # the artifact, which does not depend on the language base.
    cosines: dict[str, float] = field(default_factory=dict)


def included_tensors(params: MaecParams, tensors: list[PlannedTensor]) -> list[PlannedTensor]:
    params.check_selection((t.name, len(t.shape)) for t in tensors)
    return [t for t in tensors if params.is_included(t.name, len(t.shape))]


def _rows2d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1) if t.dim() > 0 else t.reshape(1, 1)


# Elements per CPU scoring slice: two float32 slices of 1 MB stay in the CPU cache while
# they are converted, subtracted and reduced, instead of four passes over a 50 MB tensor.
CHUNK_CPU = 1 << 18


class Scratch:
    """Reused float32 buffers for the per-tensor arithmetic.

    A fresh 50 MB tensor is mmapped by the allocator and page-faulted in on first touch,
    which costs more than the conversion it holds; buffers allocated once avoid that.
    """

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor] = [torch.empty(0), torch.empty(0)]

    def buf(self, slot: int, n: int, device: torch.device) -> torch.Tensor:
        b = self._bufs[slot]
        if b.numel() < n or b.device != device:
            b = self._bufs[slot] = torch.empty(n, dtype=torch.float32, device=device)
        return b[:n]


def row_scores(a: torch.Tensor, b: torch.Tensor, scratch: Scratch | None = None
               ) -> torch.Tensor:
    """Float32 ``mean_j |a[i, j] − b[i, j]|`` per row of ``a`` viewed as ``(shape[0], -1)``.

    The mean is the L1 norm of the row over its width (one fused reduction). On CPU the
    compiled kernel (``maec_core.native``) gives torch's sums bit for bit when it is
    built; otherwise the rows go through torch in cache-sized slices of whole rows (each
    row's reduction is the same whatever the slice). On a GPU, in one piece.
    """
    scratch = scratch or Scratch()
    a2, b2 = _rows2d(a), _rows2d(b)
    rows, width = a2.shape
    if a.device.type != "cpu":
        x = scratch.buf(0, a2.numel(), a.device).view(rows, width)
        x.copy_(a2).sub_(b2)
        norms: torch.Tensor = torch.linalg.vector_norm(x, 1, dim=1)
        return norms.div_(width)
    # The compiled kernel when built: the same float32 sums, several times faster.
    fast = native_l1_rows(a2, b2)
    if fast is not None:
        return fast.div_(width)
    out = torch.empty(rows, dtype=torch.float32)
    step = max(1, CHUNK_CPU // max(width, 1))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        n = (r1 - r0) * width
        x = scratch.buf(0, n, a.device).view(r1 - r0, width).copy_(a2[r0:r1])
        y = scratch.buf(1, n, a.device).view(r1 - r0, width).copy_(b2[r0:r1])
        torch.linalg.vector_norm(x.sub_(y), 1, dim=1, out=out[r0:r1])
    return out.div_(width)


def delta_scores(granularity: str, a: torch.Tensor, b: torch.Tensor,
                 scratch: Scratch | None = None) -> torch.Tensor:
    """Float32 importance from the delta: mean |θA − θ0| per row, or |θA − θ0| per element."""
    if granularity == "element":
        return (a.float() - b.float()).abs_().flatten()
    return row_scores(a, b, scratch)


def key_delta(granularity: str, a: torch.Tensor, ref: torch.Tensor, idx: torch.Tensor
              ) -> torch.Tensor:
    """Float32 ``θA − θref`` on the key positions, both tensors in memory."""
    return _gather(granularity, a, idx).float().sub_(_gather(granularity, ref, idx).float())


# Elements per read block of the row-scoring stream (4 MB of bf16 per input): few
# syscalls, and a few blocks per input in memory whatever the tensor sizes (on CPU the
# buffer sets below hold 32 MB of bf16 in all).
BLOCK_ELEMS = 1 << 21
# On CPU, blocks are read and scored by this many threads, each taking a block end to
# end (pread, float32 round trip, L1 reductions): both cores stay busy, where a reader
# thread beside scoring split in halves left a third of them idle waiting on each other.
CPU_SCORERS = 2
# Blocks read or scored ahead of the oldest one not yet handed on (a buffer set each):
# the scorers keep going while the caller stores a finished tensor's key rows.
CPU_BLOCKS_AHEAD = 4

_Block = tuple[int, int, int]  # (tensor position, first row, end row)


def stream_row_scores(
    cands: list[PlannedTensor], keys: tuple[str, str], device: torch.device,
    tick: Callable[[], None],
) -> Iterator[tuple[PlannedTensor, torch.Tensor]]:
    """(tensor, float32 mean |θA − θ0| per row) for each tensor, reading in row blocks.

    Whole rows are read in blocks of about ``BLOCK_ELEMS`` into buffers allocated once,
    so memory is a few blocks rather than a few tensors (the largest tensors,
    embeddings, are not candidates, but an MLP matrix is 50-500 MB in float32). On a GPU
    a block is a whole tensor, read on a thread while the previous one is scored.
    """
    plan: list[_Block] = []
    for ti, t in enumerate(cands):
        rows = _rows_of(t)
        width = t.numel // max(rows, 1)
        step = rows if device.type != "cpu" else max(1, BLOCK_ELEMS // max(width, 1))
        plan += [(ti, r0, min(rows, r0 + step)) for r0 in range(0, rows, step)] or [(ti, 0, 0)]
    biggest = max((r1 - r0) * (cands[ti].numel // max(_rows_of(cands[ti]), 1))
                  for ti, r0, r1 in plan)
    itemsize = max(cands[0].sources[k].nbytes // max(cands[0].numel, 1) for k in keys)
    sets = CPU_BLOCKS_AHEAD if device.type == "cpu" else 2
    bufs = [[torch.empty(biggest * itemsize, dtype=torch.uint8) for _ in keys]
            for _ in range(sets)]
    stream = _cpu_scores if device.type == "cpu" else _device_scores
    with RowReader() as io:
        for t, scores in stream(cands, plan, keys, bufs, io, device):
            yield t, scores
            tick()


def _rows_of(t: PlannedTensor) -> int:
    return t.shape[0] if t.shape else 1


def _cpu_scores(cands: list[PlannedTensor], plan: list[_Block], keys: tuple[str, str],
                bufs: list[list[torch.Tensor]], io: RowReader, device: torch.device
                ) -> Iterator[tuple[PlannedTensor, torch.Tensor]]:
    """The CPU stream: ``CPU_SCORERS`` threads each read and score whole blocks, handed
    on in plan order, so tensors come out in order."""
    free: queue.Queue[list[torch.Tensor]] = queue.Queue()
    for held in bufs:
        free.put(held)
    local = threading.local()
    scores: dict[int, torch.Tensor] = {}

    def score(block: _Block, held: list[torch.Tensor]) -> None:
        ti, r0, r1 = block
        try:
            if r1 > r0:
                t = cands[ti]
                a, b = (io.read_row_range(t.sources[k], r0, r1, held[i])
                        for i, k in enumerate(keys))
                if not hasattr(local, "scratch"):
                    local.scratch = Scratch()
                scores[ti][r0:r1] = row_scores(a, b, local.scratch)
        finally:
            free.put(held)

    ahead: collections.deque[tuple[_Block, Future[None]]] = collections.deque()
    pool = ThreadPoolExecutor(max_workers=CPU_SCORERS, thread_name_prefix="maec-score")

    def oldest() -> tuple[PlannedTensor, torch.Tensor] | None:
        """Wait for the oldest block; its tensor when that block was the last one."""
        (ti, _, r1), fut = ahead.popleft()
        fut.result()
        return (cands[ti], scores.pop(ti)) if r1 == _rows_of(cands[ti]) else None

    try:
        for block in plan:
            if block[1] == 0:
                scores[block[0]] = torch.empty(_rows_of(cands[block[0]]), dtype=torch.float32)
            while len(ahead) >= len(bufs):
                done = oldest()
                if done is not None:
                    yield done
            # Fewer blocks in flight than buffer sets, so one is free: a block returns
            # its set before its future completes.
            ahead.append((block, pool.submit(score, block, free.get())))
        while ahead:
            done = oldest()
            if done is not None:
                yield done
    finally:
        for _, fut in ahead:
            fut.cancel()
        pool.shutdown(wait=True)


def _device_scores(cands: list[PlannedTensor], plan: list[_Block], keys: tuple[str, str],
                   bufs: list[list[torch.Tensor]], io: RowReader, device: torch.device
                   ) -> Iterator[tuple[PlannedTensor, torch.Tensor]]:
    """The GPU stream: the next tensor is read on a thread while this one is scored."""

    def load(j: int) -> list[torch.Tensor]:
        ti, r0, r1 = plan[j]
        t = cands[ti]
        return [io.read_row_range(t.sources[k], r0, r1, bufs[j % 2][i])
                for i, k in enumerate(keys)]

    scratch = Scratch()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="maec-rows")
    try:
        fut = pool.submit(load, 0)
        scores: torch.Tensor | None = None
        for j, (ti, r0, r1) in enumerate(plan):
            a, b = fut.result()
            if j + 1 < len(plan):
                fut = pool.submit(load, j + 1)  # fills the other buffer set
            t = cands[ti]
            if r0 == 0:
                scores = torch.empty(_rows_of(t), dtype=torch.float32, device=device)
            assert scores is not None
            if r1 > r0:
                scores[r0:r1] = row_scores(a.to(device), b.to(device), scratch)
            if r1 == _rows_of(t):
                yield t, scores
                scores = None
    finally:
        pool.shutdown(wait=True)


def _gather(granularity: str, t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    if granularity == "element":
        return t.reshape(-1)[idx]
    return _rows2d(t)[idx]


def _stats(scores: torch.Tensor, kept: torch.Tensor) -> dict[str, float]:
    s = scores.double()
    cut = float(scores[kept].min()) if kept.numel() else 0.0
    return {"min": float(s.min()), "max": float(s.max()), "mean": float(s.mean()),
            "cut": cut}


class _ArtifactSink:
    """Streams (index, delta) pairs into the artifact's safetensors file, in plan order."""

    def __init__(self, staged: StagedOutput, params: MaecParams, art_dtype: str,
                 counts: list[tuple[PlannedTensor, int]]) -> None:
        self.dtype = torch_dtype(art_dtype)
        st = SAFETENSORS_NAMES[self.dtype]
        outs: list[OutputTensor] = []
        for t, k in counts:
            if k == 0:
                continue
            outs.append(OutputTensor(t.name + INDEX_SUFFIX, (k,),
                                     index_dtype(params.granularity, t.numel)))
            outs.append(OutputTensor(t.name + DELTA_SUFFIX,
                                     delta_shape(params.granularity, t.shape, k), st))
        self.granularity = params.granularity
        self.writer = ShardedWriter(staged.folder, outs, _ONE_SHARD)
        self.staged = staged
        self.cosines: dict[str, float] = {}
        self.cosine = Cosine()

    def write(self, t: PlannedTensor, idx: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Store the key entries ``idx`` and their values; returns the values as stored."""
        ityp = torch.int32 if index_dtype(self.granularity, t.numel) == "I32" else torch.int64
        self.writer.write(t.name + INDEX_SUFFIX, idx.to("cpu", ityp))
        shape = delta_shape(self.granularity, t.shape, idx.numel())
        stored = values.reshape(shape).to("cpu", self.dtype)
        self.writer.write(t.name + DELTA_SUFFIX, stored)
        return stored

    def close(self) -> dict[str, Any]:
        files = self.writer.close()
        (written,) = files
        # ShardedWriter names a single shard model.safetensors; an artifact is not a model.
        final = self.staged.folder / WEIGHTS_NAME
        (self.staged.folder / written.path).rename(final)
        # The size from the file itself: it is what readers check against.
        return {"name": WEIGHTS_NAME, "size": final.stat().st_size, "sha256": written.sha256}


@dataclass
class _Extraction:
    """What every step of one ability's extraction shares."""

    params: MaecParams
    cands: list[PlannedTensor]
    device: torch.device
    ref_key: str  # "control" (θS) when given, else "base" (θ0)
    tick: Callable[[], None]
    # The language base's tensors by name, to compute c_t against on the way (row
    # granularity); None: selection computes them.
    language: Mapping[str, TensorInfo] | None = None

    @property
    def gran(self) -> str:
        return self.params.granularity

    def n_of(self, t: PlannedTensor) -> int:
        """Candidates (rows or elements) of ``t``."""
        return t.numel if self.gran == "element" else (t.shape[0] if t.shape else 1)

    def local_count(self, t: PlannedTensor) -> int:
        return key_count(self.params.key_ratio, self.n_of(t))


@dataclass
class _Scores:
    """What a first pass found: every tensor's scores, or a global element cut."""

    scores: dict[str, torch.Tensor] | None = None
    global_cut: GlobalSelection | None = None
    gradient: dict[str, Any] | None = None


@dataclass(frozen=True)
class AbilityInputs:
    """The checkpoints one extraction reads: θ0, the donor θA, the optional control
    (the reference the donor's change is measured from instead of θ0), and the gradient
    corpus when importance is ``gradient``."""

    base: ModelFolder
    ability: ModelFolder
    control: ModelFolder | None = None
    corpus: str | None = None
    # A one-run merge's language base: at row granularity each tensor's c_t is then
    # computed here from the key rows already read (what selection would compute from
    # the stored artifact, bit for bit), sparing selection a pass.
    language: ModelFolder | None = None


def extract_ability(
    params: MaecParams,
    key_document: dict[str, Any],
    inputs: AbilityInputs,
    out_dir: Path,
    ctx: RunContext,
    step: StepFn | None = None,
) -> ExtractResult:
    """Write the artifact of one ability to ``out_dir`` (atomically).

    ``key_document`` comes from ``keys.key_document`` for the same inputs and parameters;
    ``step()`` is called once per tensor per pass (see ``passes``); of ``ctx`` the device,
    cancel, overwrite and resident files apply (progress goes through ``step``).
    """
    base, ability, control, corpus = inputs.base, inputs.ability, inputs.control, inputs.corpus
    device, cancel = best_device(ctx.device), ctx.cancel
    started = time.perf_counter()
    models = {"base": base, "ability": ability}
    if control is not None:
        models["control"] = control
    plan = build_plan(models, "base")  # names, shapes and dtypes agree: headers only

    def tick() -> None:
        if cancel is not None and cancel():
            raise Cancelled("extraction cancelled")
        if step is not None:
            step()

    job = _Extraction(params, included_tensors(params, plan.tensors), device,
                      "control" if control is not None else "base", tick,
                      inputs.language.tensors if inputs.language is not None
                      and params.granularity == "row" else None)
    first = _first_pass(job, base, corpus, cancel)
    counts, chosen = _key_counts(job, first)
    art_dtype = key_document["parameters"]["artifact_dtype"]
    with StagedOutput(out_dir, overwrite=ctx.overwrite) as staged, \
            RowReader(ctx.options.resident) as rows_io:
        sink = _ArtifactSink(staged, params, art_dtype, counts)
        try:
            if first.scores is not None:
                entries = _write_chosen(job, sink, rows_io, chosen, first.scores)
            elif job.gran == "row":
                entries = _write_rows(job, sink, rows_io)
            else:
                entries = _write_elements(job, sink, rows_io, first.global_cut)
            file_doc = sink.close()
        except BaseException:
            sink.writer.abort()
            raise
        meta = _metadata(key_document, plan.input_dtype, sum(t.numel for t in plan.tensors),
                         entries, first.gradient, file_doc)
        staged.write_json(META_NAME, meta)
        staged.commit()
    return ExtractResult(out_dir, meta["key"], meta, time.perf_counter() - started,
                         sink.cosines)


def _first_pass(job: _Extraction, base: ModelFolder, corpus: str | None,
                cancel: CancelFn | None) -> _Scores:
    """The pass before writing, when ranking needs one: gradient scores, global row
    scores, or the global element cut. Local delta ranking needs none (``_Scores()``)."""
    params, cands = job.params, job.cands
    if params.importance == "gradient":
        from maec_core.maec.gradient import gradient_scores

        assert corpus is not None
        scores, stats = gradient_scores(
            params, base, corpus, [t.name for t in cands], job.device, cancel=cancel
        )
        for _ in cands:
            job.tick()
        return _checked(_Scores(scores=scores, gradient=stats), cands)
    if params.rank_scope != "global":
        return _Scores()
    if job.gran == "row":
        with cpu_single_thread(job.device):
            scores = {t.name: s.cpu() for t, s in
                      stream_row_scores(cands, ("ability", "base"), job.device, job.tick)}
        return _checked(_Scores(scores=scores), cands)

    # Element scores of the whole model are not held: a radix select streams θ0 and θA
    # once per 16-bit digit of the ranking key (usually twice) to find the cut.
    def element_scores() -> Iterator[tuple[str, torch.Tensor]]:
        with TensorReader() as reader:
            steps = [[t.sources["base"], t.sources["ability"]] for t in cands]
            for t, (b, a) in zip(cands, Prefetcher(reader, steps), strict=True):
                s = delta_scores(job.gran, a.to(job.device), b.to(job.device))
                check_scores(t.name, s)
                yield t.name, s

    with cpu_single_thread(job.device):
        cut = select_global(
            element_scores, {t.name: job.n_of(t) for t in cands},
            key_count(params.key_ratio, sum(job.n_of(t) for t in cands)),
        )
    for _ in cands:
        job.tick()
    return _Scores(global_cut=cut)


def _checked(first: _Scores, cands: list[PlannedTensor]) -> _Scores:
    assert first.scores is not None
    for t in cands:
        check_scores(t.name, first.scores[t.name])
    return first


def _key_counts(job: _Extraction, first: _Scores
                ) -> tuple[list[tuple[PlannedTensor, int]], dict[str, torch.Tensor]]:
    """Key entries per tensor (the artifact's layout) and, when scores are known, the
    chosen key indices per tensor."""
    cands = job.cands
    if first.global_cut is not None:
        cut = first.global_cut
        return [(t, cut.counts[t.name]) for t in cands], {}
    if first.scores is None:
        return [(t, job.local_count(t)) for t in cands], {}
    scores = first.scores
    if job.params.rank_scope == "global":
        total = sum(job.n_of(t) for t in cands)
        picks = global_top_k([scores[t.name] for t in cands], [t.name for t in cands],
                             key_count(job.params.key_ratio, total))
    else:
        picks = [top_k_indices(scores[t.name], job.local_count(t)) for t in cands]
    chosen = {t.name: p for t, p in zip(cands, picks, strict=True)}
    return [(t, int(chosen[t.name].numel())) for t in cands], chosen


def _write_rows(job: _Extraction, sink: _ArtifactSink, rows_io: RowReader
                ) -> list[dict[str, Any]]:
    """Single pass: θ0 and θA streamed in row blocks for the scores, then θA and θref
    (θ0 or θS) read again on the key rows only (key_ratio of them)."""
    entries: list[dict[str, Any]] = []
    with cpu_single_thread(job.device):
        for t, s in stream_row_scores(job.cands, ("ability", "base"), job.device, job.tick):
            check_scores(t.name, s)
            idx = top_k_indices(s, job.local_count(t))
            _store_keys(job, sink, rows_io, t, idx)
            entries.append(_entry(t, job.n_of(t), idx, s))
    return entries


def _write_elements(job: _Extraction, sink: _ArtifactSink, rows_io: RowReader,
                    global_cut: GlobalSelection | None) -> list[dict[str, Any]]:
    """Element granularity: θ0 and θA in full (prefetched); θS read where kept."""
    entries: list[dict[str, Any]] = []
    scratch = Scratch()
    with TensorReader() as reader, cpu_single_thread(job.device):
        steps = [[t.sources["base"], t.sources["ability"]] for t in job.cands]
        for t, (b, a) in zip(job.cands, Prefetcher(reader, steps), strict=True):
            a, b = a.to(job.device), b.to(job.device)
            s = delta_scores(job.gran, a, b, scratch)
            check_scores(t.name, s)
            if global_cut is not None:
                idx = global_cut.keep(t.name, s)
            else:
                idx = top_k_indices(s, job.local_count(t))
            if not idx.numel():
                pass  # ranked out globally: nothing to store
            elif job.ref_key == "base":
                sink.write(t, idx, key_delta(job.gran, a, b, idx))
            else:
                sink.write(t, idx, _control_delta(job.gran, rows_io, idx, a,
                                                  t.sources["control"]))
            entries.append(_entry(t, job.n_of(t), idx, s))
            del a, b
            job.tick()
    return entries


def _write_chosen(job: _Extraction, sink: _ArtifactSink, rows_io: RowReader,
                  chosen: dict[str, torch.Tensor], scores: dict[str, torch.Tensor]
                  ) -> list[dict[str, Any]]:
    """Scores known: read θA and θref only where the mask is set."""
    entries: list[dict[str, Any]] = []
    for t in job.cands:
        idx = chosen[t.name]
        if idx.numel():
            _store_keys(job, sink, rows_io, t, idx)
        entries.append(_entry(t, job.n_of(t), idx, scores[t.name]))
        job.tick()
    return entries


def _metadata(key_document: dict[str, Any], checkpoint_dtype: str, model_weights: int,
              entries: list[dict[str, Any]], gradient: dict[str, Any] | None,
              file_doc: dict[str, Any]) -> dict[str, Any]:
    """The artifact's ``ability.json``."""
    return {
        "format": key_document["format"],
        "format_version": key_document["format_version"],
        "key": key_of(key_document),
        "key_document": key_document,
        "checkpoint_dtype": checkpoint_dtype,
        "tensors": entries,
        "totals": {
            "tensors": len(entries),
            "candidates": sum(e["candidates"] for e in entries),
            "kept": sum(e["kept"] for e in entries),
            "weights": sum(e["kept"] * e["row_width"] for e in entries),
            "model_weights": model_weights,
        },
        "gradient": gradient,
        "file": file_doc,
    }


def _entry(t: PlannedTensor, n: int, idx: torch.Tensor, scores: torch.Tensor) -> dict[str, Any]:
    width = t.numel // n if n else 0
    return {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "candidates": n,
            "kept": int(idx.numel()), "row_width": width,
            "score": _stats(scores, idx.to(scores.device))}


def _control_delta(gran: str, io: RowReader, idx: torch.Tensor, a: torch.Tensor,
                   ref_info: Any) -> torch.Tensor:
    """θA − θS on the key positions: θA in memory, θS read only there (rows)."""
    a_k = _gather(gran, a, idx).float()
    if gran == "element":
        ref = io.read(ref_info).reshape(-1)[idx.cpu()]
    else:
        ref = io.read_rows(ref_info, idx.cpu())
    return a_k.sub_(ref.to(a_k.device, torch.float32))


def _store_keys(job: _Extraction, sink: _ArtifactSink, io: RowReader, t: PlannedTensor,
                idx: torch.Tensor) -> None:
    """Write θA − θref on the key positions ``idx`` of ``t``; with ``job.language`` also
    c_t, from the values as stored and the key rows of the language base and θ0 (θ0's
    read once when it is the reference). A tensor the language base stores otherwise
    (another shape or dtype) is left to selection."""
    lang_info = job.language.get(t.name) if job.language is not None else None
    base_info = t.sources["base"]
    if lang_info is None or (lang_info.shape, lang_info.dtype) != (base_info.shape,
                                                                   base_info.dtype):
        sink.write(t, idx, _masked_delta(job.gran, io, t, idx, job.ref_key, job.device))
        return
    rows = idx.cpu()
    delta, ref = _row_delta(io, t, rows, job.ref_key, job.device)
    stored = sink.write(t, idx, delta)
    base = ref if job.ref_key == "base" else io.read_rows(base_info, rows)
    lang = io.read_rows(lang_info, rows).float()
    # As selection computes it from the artifact: cos(R(A), (θL − θ0)) on the key rows.
    sink.cosines[t.name] = sink.cosine(stored.float(), lang.sub_(base.float()))


def _masked_delta(gran: str, io: RowReader, t: PlannedTensor, idx: torch.Tensor,
                  ref_key: str, device: torch.device) -> torch.Tensor:
    """θA − θref on the key positions, reading only those rows (rows) or tensors (element)."""
    idx = idx.cpu()
    if gran != "element":
        return _row_delta(io, t, idx, ref_key, device)[0]
    a = io.read(t.sources["ability"]).reshape(-1)[idx]
    r = io.read(t.sources[ref_key]).reshape(-1)[idx]
    return a.to(device, torch.float32).sub_(r.to(device, torch.float32))


def _row_delta(io: RowReader, t: PlannedTensor, rows: torch.Tensor, ref_key: str,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(θA − θref in float32 on ``rows``, θref's rows as stored): the reference's rows
    are returned for a caller that needs them again (c_t against θ0)."""
    ref = io.read_rows(t.sources[ref_key], rows)
    a = io.read_rows(t.sources["ability"], rows)
    return a.to(device, torch.float32).sub_(ref.to(device, torch.float32)), ref
