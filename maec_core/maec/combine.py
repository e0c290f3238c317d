"""Stage 2 — combination: select ability tensors by c_t, then θ* = θL + Σ_k μ_k R(A_k).

Two passes, neither holding more than a few tensors:
1. Selection: for every tensor carrying ability weights, read θL and θ0 *on the key
   rows only* (about key_ratio of the bytes) and the stored R(A) values, and compute
   ``c_t = cos(R(A)[t], (θL − θ0)[t])`` restricted to those rows, in float64 on the CPU
   so the decision is the same on every machine. Then keep the tensors by ratio/threshold.
2. Merge: the engine's streaming loop over θL alone; a selected tensor gets
   ``index_add_`` of its stored rows times μ_k, in float32, cast once by the engine.
θ0 is never read in full and θA not at all: an artifact is all combination needs.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from maec_core.accounting import TIED_LM_HEAD
from maec_core.context import OutputSpec, RunContext
from maec_core.engine import MergeWork, stream_merge
from maec_core.errors import ArtifactMismatch, Cancelled
from maec_core.io.folder import ModelFolder
from maec_core.io.headers import TensorInfo
from maec_core.maec.artifact import Artifact
from maec_core.maec.params import MaecParams
from maec_core.maec.rowio import RowReader
from maec_core.maec.select import select_tensors
from maec_core.maec.vocab import TokenMap
from maec_core.plan import LM_HEAD, MergePlan, PlannedTensor, tensor_of
from maec_core.runtime import (
    MergeResult,
    cpu_single_thread,
)
from maec_core.vocab.build import is_vocab_tensor

StepFn = Callable[[int, int], None]


@dataclass
class Selection:
    """Per ability: c_t of every carrying tensor and the names kept."""

    cosines: list[dict[str, float]]
    kept: list[set[str]]


class Cosine:
    """cos(vec a, vec b) in float64; 0 when either vector is all zeros.

    The float64 copies go into two buffers kept between calls: a fresh buffer of a few
    MB per tensor costs its page faults, several times the arithmetic (the values, and
    so the result, are the same)."""

    def __init__(self) -> None:
        self._bufs = (torch.empty(0, dtype=torch.float64), torch.empty(0, dtype=torch.float64))

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> float:
        n = a.numel()
        if self._bufs[0].numel() < n:
            self._bufs = (torch.empty(n, dtype=torch.float64),
                          torch.empty(n, dtype=torch.float64))
        a64 = self._bufs[0][:n].copy_(a.reshape(-1))
        b64 = self._bufs[1][:n].copy_(b.reshape(-1))
        na, nb = float(torch.linalg.vector_norm(a64)), float(torch.linalg.vector_norm(b64))
        if na == 0.0 or nb == 0.0:
            return 0.0
        return float(torch.dot(a64, b64)) / (na * nb)


class RowRemap:
    """Moves an artifact's key rows of the embedding and LM head from θ0's token order to
    θL's (same token string); rows of tokens θL lacks are dropped."""

    def __init__(self, tmap: TokenMap) -> None:
        self.to_lang = torch.tensor(tmap.to_lang, dtype=torch.int64)

    def __call__(self, name: str, idx: torch.Tensor, values: torch.Tensor, width: int,
                 element: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(θ0 indices kept, their θL indices, their values), by ascending θL index.
        Tensors other than the embedding and LM head pass through unchanged."""
        if not is_vocab_tensor(name):
            return idx, idx, values
        rows = idx // width if element else idx
        moved = self.to_lang[rows]
        keep = moved >= 0
        lang = moved[keep] * width + (idx[keep] % width) if element else moved[keep]
        order = torch.argsort(lang)
        return idx[keep][order], lang[order], values[keep][order]


def _row_width(t: PlannedTensor) -> int:
    width = 1
    for d in t.shape[1:]:
        width *= d
    return width


def _key_values(io: RowReader, art: Artifact, info: TensorInfo, idx: torch.Tensor) -> torch.Tensor:
    if art.granularity == "element":
        return io.read(info).reshape(-1)[idx]
    return io.read_rows(info, idx)


def select(
    params: MaecParams,
    plan: MergePlan,
    artifacts: list[Artifact],
    ctx: RunContext,
    *,
    keys: tuple[str, str],
    step: StepFn | None = None,
    remap: RowRemap | None = None,
    known: Mapping[str, Mapping[str, float]] | None = None,
) -> Selection:
    """c_t of every tensor each artifact carries (:func:`measure`), and the tensors kept
    by the selection parameters (:func:`decide`)."""
    return decide(params, measure(plan, artifacts, ctx, keys=keys, step=step, remap=remap,
                                  known=known))


def decide(params: MaecParams, cosines: list[dict[str, float]]) -> Selection:
    """The tensors kept, per ability, from the c_t of every tensor it carries: the
    selection rule, applied once to all of them (a split merge's parts measure c_t;
    the rule runs here, on the whole model's)."""
    return Selection(cosines, [select_tensors(cs, mode=params.selection,
                                              ratio=params.selection_ratio,
                                              threshold=params.selection_threshold)
                               for cs in cosines])


def check_decided(selection: Selection, artifacts: list[Artifact]) -> None:
    """A selection made elsewhere (a split merge's) has the c_t of exactly the tensors
    each artifact carries: what :func:`select` would have measured."""
    if len(selection.cosines) != len(artifacts) or any(
            set(cs) != set(art.tensors) for cs, art in zip(selection.cosines, artifacts,
                                                           strict=False)):
        raise ArtifactMismatch("the recorded tensor selection does not cover the tensors "
                               "the ability vectors carry")


def measure(
    plan: MergePlan,
    artifacts: list[Artifact],
    ctx: RunContext,
    *,
    keys: tuple[str, str],
    step: StepFn | None = None,
    remap: RowRemap | None = None,
    known: Mapping[str, Mapping[str, float]] | None = None,
    only: Collection[str] | None = None,
) -> list[dict[str, float]]:
    """Per artifact, c_t of every tensor it carries (of those in ``only``, when given:
    one part's tensors). ``keys``: the plan's (base, language base) model keys.
    ``known`` (artifact key -> tensor -> c_t, from an earlier combination of the same
    inputs) spares reading the key rows again: c_t depends on the artifact and the two
    checkpoints only, not on μ or the selection parameters. Key rows of the files
    ``ctx.options.resident`` holds are taken from memory; ``ctx.cancel`` is honoured
    between tensors (not ``ctx.progress``: ``step(done, total)`` reports)."""
    base_key, language_key = keys
    by_name = {t.name: t for t in plan.tensors}
    total = sum(len([n for n in a.tensors if only is None or n in only]) for a in artifacts)
    done = 0
    cosines: list[dict[str, float]] = []
    cosine_of = Cosine()
    with RowReader(ctx.options.resident) as io, cpu_single_thread(torch.device("cpu")):
        for art in artifacts:
            cs: dict[str, float] = {}
            given = (known or {}).get(art.key)
            for name in art.tensors:
                if only is not None and name not in only:
                    continue
                if given is not None and name in given:
                    cs[name] = given[name]
                    continue
                if ctx.cancelled():
                    raise Cancelled("combination cancelled")
                t = by_name[name]
                idx, r_a = art.read(name, io)
                idx_l = idx
                if remap is not None:
                    idx, idx_l, r_a = remap(name, idx, r_a, _row_width(t),
                                            art.granularity == "element")
                lang = _key_values(io, art, t.sources[language_key], idx_l).float()
                base = _key_values(io, art, t.sources[base_key], idx).float()
                cs[name] = cosine_of(r_a, lang.sub_(base))
                done += 1
                if step is not None:
                    step(done, total)
            cosines.append(cs)
    return cosines


@dataclass(frozen=True)
class Combination:
    """What combination adds to the language base (the plan's ``language_key`` model):
    per ability its artifact, the tensors ``selection`` kept and its weight ``mus[k]``;
    ``remap`` moves vocabulary rows from θ0's token order to the language base's."""

    artifacts: list[Artifact]
    selection: Selection
    mus: list[float]
    language_key: str
    remap: RowRemap | None = None
    # For the manifest's accounting: which abilities have a control (their vector is
    # donor − control, so θ0's values are not in it).
    controlled: Sequence[bool] = ()


def merge(plan: MergePlan, combination: Combination, output: OutputSpec, ctx: RunContext
          ) -> MergeResult:
    """θ* = θL + Σ_k μ_k R(A_k) over the selected tensors, published as ``output``
    (``output.tokenizer_from`` is the language base's key)."""
    artifacts, selection, mus = combination.artifacts, combination.selection, combination.mus
    language_key, remap = combination.language_key, combination.remap
    # Which abilities add to each tensor, in ability order (the float32 sums are ordered).
    adds: dict[str, list[int]] = {}
    for k, kept in enumerate(selection.kept):
        if mus[k] == 0.0:
            # θL + 0·R is not bitwise θL when θL holds -0.0; μ = 0 must leave θL as it is.
            continue
        for name in sorted(kept):
            adds.setdefault(name, []).append(k)
    # The stored ability vectors come from memory too when the options hold them.
    reader = RowReader(ctx.options.resident)
    adder = SparseAdder(artifacts, adds, mus, reader, remap)

    def read(t: PlannedTensor) -> list[TensorInfo]:
        return [t.sources[language_key]]

    # θ0 (the plan's other model) goes into a tensor through the ability vectors
    # (donor − θ0) when an ability without a control adds to it; it is never read here.
    # The donors are not among the plan's models: combination reads the artifacts, whose
    # metadata record them, so a run from given artifacts publishes the same manifest.
    others = [k for k in plan.models if k != language_key]
    controlled = list(combination.controlled) or [False] * len(artifacts)

    def feeds(t: PlannedTensor) -> list[str]:
        ks = adds.get(t.name, [])
        return [language_key, *(others if any(not controlled[k] for k in ks) else [])]

    plan = dataclasses.replace(plan, left_out=_not_added(
        plan, {k: plan.models[k] for k in others}, feeds, adds))

    def whole(t: PlannedTensor, inputs: list[torch.Tensor]) -> torch.Tensor:
        return adder(t, inputs, 0)

    # Key rows change a few percent of θL: its other bytes are copied as they are.
    rows = all(a.granularity == "row" for a in artifacts)
    try:
        # Element-wise streaming over θL with slice offsets: the engine's fastest loop,
        # and a few MB of memory whatever the tensor sizes.
        return stream_merge(plan, MergeWork(whole, read, stage="combine", compute_at=adder,
                                            patch_at=adder.patch if rows else None,
                                            feeds=feeds, added=frozenset(adds)),
                            output, ctx)
    finally:
        reader.close()


NOT_ADDED = ("MAEC adds no ability to this tensor (not selected, or its weight mu is 0): "
             "the language base's tensor is kept")
CONTROLLED = ("MAEC's ability vectors for this tensor are donor - control: the base only "
              "chose their key positions")


def _not_added(plan: MergePlan, folders: Mapping[str, ModelFolder],
               feeds: Callable[[PlannedTensor], list[str]], adds: Mapping[str, list[int]]
               ) -> dict[str, dict[str, str]]:
    """The plan's left-out tensors plus, of ``folders`` (θ0: the checkpoint only the
    ability vectors bring in), those that ``feeds`` into no output tensor, and an
    lm_head the output ties to its embedding."""
    out = {k: dict(v) for k, v in plan.left_out.items()}
    planned = {t.name for t in plan.tensors}
    for key, folder in folders.items():
        infos = [(t, tensor_of(folder, t.name)) for t in plan.tensors]
        used = {info.name for t, info in infos if info is not None and key in feeds(t)}
        for t, info in infos:
            if info is not None and info.name not in used:
                out.setdefault(key, {})[info.name] = CONTROLLED if t.name in adds else NOT_ADDED
        if LM_HEAD in folder.tensors and LM_HEAD not in planned:
            out.setdefault(key, {}).setdefault(LM_HEAD, TIED_LM_HEAD)
    return out


class SparseAdder:
    """Adds ``μ_k · R(A_k)`` to flat slices of θL, given each slice's offset.

    Per tensor, the stored key rows are loaded once (on its first slice) and kept as
    (flat start of each row, float32 values); a slice ``[o, o + m)`` then adds the parts
    of the rows that overlap it, ability by ability in recipe order, so every weight gets
    the same float32 operations in the same order however the tensor is sliced.
    """

    def __init__(self, artifacts: list[Artifact], adds: dict[str, list[int]],
                 mus: list[float], reader: RowReader, remap: RowRemap | None = None) -> None:
        self._remap = remap
        self._artifacts = artifacts
        self._adds = adds
        self._mus = mus
        self._reader = reader
        self._name: str | None = None
        self._parts: list[tuple[list[int], torch.Tensor, torch.Tensor, int, float]] = []

    def _load(self, t: PlannedTensor, device: torch.device) -> None:
        self._parts = []
        for k in self._adds.get(t.name, ()):
            art = self._artifacts[k]
            idx, values = art.read(t.name, self._reader)
            if self._remap is not None:
                # θL's rows for the artifact's θ0 rows (the embedding and LM head).
                _, idx, values = self._remap(t.name, idx, values, _row_width(t),
                                             art.granularity == "element")
            width = 1 if art.granularity == "element" else t.numel // max(t.shape[0], 1)
            starts = idx * width
            self._parts.append((starts.tolist(), starts.to(device),
                                values.reshape(idx.numel(), -1).to(device), width,
                                self._mus[k]))
        self._name = t.name

    def __call__(self, t: PlannedTensor, inputs: list[torch.Tensor], offset: int
                 ) -> torch.Tensor:
        out = inputs[0].view(-1)
        if t.name != self._name:
            self._load(t, out.device)
        end = offset + out.numel()
        for starts, starts_dev, values, width, mu in self._parts:
            # Rows overlapping [offset, end): start < end and start + width > offset.
            lo = bisect.bisect_right(starts, offset - width)
            hi = bisect.bisect_left(starts, end)
            if lo >= hi:
                continue
            if width == 1:
                out.index_add_(0, starts_dev[lo:hi] - offset, values[lo:hi, 0], alpha=mu)
                continue
            for i in range(lo, hi):
                r0 = starts[i]
                a, b = max(r0, offset), min(r0 + width, end)
                out[a - offset: b - offset].add_(values[i, a - r0: b - r0], alpha=mu)
        return inputs[0]

    def patch(self, t: PlannedTensor, out: torch.Tensor, offset: int) -> None:
        """Add ``μ_k · R(A_k)`` to the key rows overlapping ``out``, the slice at
        ``offset`` of θL in its own dtype (row granularity).

        Each touched entry gets what ``__call__`` gives it: θL's value in float32, the
        abilities' rows added in recipe order, one cast back. Whole rows inside the slice
        go through as one gathered block; the at most two rows cut by its ends one by one.
        """
        if t.name != self._name:
            self._load(t, out.device)
        if not self._parts:
            return
        n = out.numel()
        end = offset + n
        width = self._parts[0][3]
        if width == 1:
            # Rows of one entry go through ``index_add_`` on the float32 path: the same
            # call here, so the same arithmetic.
            out.copy_(self(t, [out.float()], offset))
            return
        # Rows wholly inside the slice start at local positions ≡ phase (mod width).
        phase = (-offset) % width
        inside = (n - phase) // width
        grid = out[phase: phase + inside * width].view(inside, width)
        whole: list[tuple[torch.Tensor, torch.Tensor, float]] = []
        cut: dict[int, list[tuple[torch.Tensor, float]]] = {}
        for starts, starts_dev, values, _, mu in self._parts:
            lo = bisect.bisect_right(starts, offset - width)
            hi = bisect.bisect_left(starts, end)
            if lo >= hi:
                continue
            first = lo if starts[lo] >= offset else lo + 1
            last = hi if starts[hi - 1] + width <= end else hi - 1
            if first < last:
                local = (starts_dev[first:last] - offset - phase) // width
                whole.append((local, values[first:last], mu))
            # The rows the slice's ends cut: the first when it starts before the slice,
            # the last when it ends after it (one row may be both).
            for i in sorted({i for i, edge in ((lo, first > lo), (hi - 1, last < hi)) if edge}):
                cut.setdefault(starts[i], []).append((values[i], mu))
        if whole:
            rows = (whole[0][0] if len(whole) == 1
                    else torch.unique(torch.cat([w[0] for w in whole])))
            block = grid.index_select(0, rows).float()
            for local, values, mu in whole:
                at = local if len(whole) == 1 else torch.searchsorted(rows, local)
                part = block if len(whole) == 1 else block.index_select(0, at)
                part.add_(values, alpha=mu)
                if len(whole) > 1:
                    block.index_copy_(0, at, part)
            grid.index_copy_(0, rows, block.to(out.dtype))
        for r0, adds in cut.items():
            a, b = max(r0, offset), min(r0 + width, end)
            row = out[a - offset: b - offset].float()
            for values_row, mu in adds:
                row.add_(values_row[a - r0: b - r0], alpha=mu)
            out[a - offset: b - offset].copy_(row)


def fmt_cos(c: float) -> str:
    return "0" if c == 0 else f"{c:+.4f}" if math.isfinite(c) else str(c)
