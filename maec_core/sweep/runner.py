"""Running a sweep: every candidate merged, scored, and all but the best thrown away.

Cost discipline (the point of a sweep over separate jobs):
- the inputs are read where they are; the eval sets are read once;
- work the method says candidates can share (its ``reuse_key``) runs once per group,
  and the group's other candidates run from what it made (``made``, ``run_reusing``).
  For MAEC each distinct extraction (per donor and extraction parameters) runs once and
  is kept in the artifact store; the other candidates of its group only combine, from
  the stored ability vectors and the c_t the first combination computed, never opening
  the donor again nor re-reading the key rows;
- the input every candidate reads whole (the method's ``held_input``: MAEC's language
  base) is read from disk once for every candidate's merge, and what a group made
  once for its candidates, when they fit in memory (a budget, by
  default half the available memory less the scoring model; ``maec_core.sweep.memory``);
  the leaderboard records whether they did;
- one candidate model is in memory at a time. With ``publish: best`` every candidate
  is merged straight into that model's weights (the engine's tensor sink), never
  written to disk and read back: the first merge writes only the model's definition
  files (config, generation config, tokenizer), which the model is built from as it
  starts; the winner is merged once more at the end into the published folder. Merges
  are deterministic (the same inputs, parameters and seeds give the same bytes), so
  that folder holds what was scored, and one more merge costs less than writing
  candidates to keep the best so far. ``publish: all`` (and a LoRA output, an adapter
  of the merge rather than its tensors) writes every candidate's folder (``keep``
  publishes it) and scores it from there, keeping the best so far on disk. So does a
  model whose checkpoint names are not its weights' names (transformers converts them
  as it loads, e.g. Mixtral's experts, stored one by one and held fused): no candidate
  can go into it by name, so each is written and loaded afresh, as a separate
  evaluation loads it;
- every temporary folder is removed, on success, failure or cancel.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from maec_core.artifact_store import ArtifactStore, LocalArtifactStore
from maec_core.context import RunContext
from maec_core.errors import Cancelled, NamesDiffer, OutputExists
from maec_core.eval.report import EvalReport, ModelResult
from maec_core.eval.sets import LoadedSet, load_sets
from maec_core.manifest import FileEntry
from maec_core.methods import get_method
from maec_core.methods.base import Made
from maec_core.recipe import Recipe
from maec_core.runtime import ProgressFn, best_device
from maec_core.sweep.attach import attach_evaluation
from maec_core.sweep.board import Leaderboard, Row, rank, score_rows, sort_key
from maec_core.sweep.grid import Candidate, candidates
from maec_core.sweep.inputs import LANGUAGE_BASE, MERGED, eval_spec, input_models

if TYPE_CHECKING:
    from maec_core.io.writer import SinkFn
    from maec_core.sweep.memory import SweepMemory
    from maec_core.sweep.scoring import ModelSlot

# keep(candidate, folder, manifest): publish one candidate (``publish: all``) before its
# folder is removed.
KeepFn = Callable[[Candidate, Path, dict[str, Any]], None]
# announce(index, total): candidate ``index`` of ``total`` starts (index == total: done).
AnnounceFn = Callable[[int, int], None]


@dataclass
class SweepResult:
    out_dir: Path
    board: Leaderboard
    report: EvalReport
    manifest: dict[str, Any]
    extractions: int
    seconds: float


@dataclass(frozen=True)
class FolderEvaluation:
    """A folder's evaluation: the report, the folder's manifest as it now stands
    (listing the evaluation files beside the merge's) and the entries of the files the
    evaluation wrote."""

    report: EvalReport
    manifest: dict[str, Any]
    added: tuple[FileEntry, ...] = ()


@dataclass
class _Best:
    """The best candidate so far: its ranking key, and its folder when it has one (a
    candidate scored from memory has none until the winner is merged again)."""

    key: tuple[float, float, int]
    cand: Candidate
    folder: Path | None
    # The folder's manifest, in memory (None: read from the folder).
    manifest: dict[str, Any] | None = None


@dataclass
class _State:
    rows: list[Row] = field(default_factory=list)
    results: list[ModelResult] = field(default_factory=list)
    best: _Best | None = None
    # What the first run of each reuse group made for the rest of it (MAEC: the stored
    # ability vectors and their c_t against the language base), as its method gave it.
    groups: dict[Any, Made] = field(default_factory=dict)
    extractions: int = 0


def evaluate_folder(recipe: Recipe, folder: Path, ctx: RunContext | None = None, *,
                    label: str = MERGED, manifest: Mapping[str, Any] | None = None
                    ) -> FolderEvaluation:
    """Score a merged ``folder`` (and with ``evaluate_inputs`` the language base and the
    donors) on the recipe's eval sets, and publish the report in the folder (files, card,
    manifest: ``manifest``, the merge's in memory, else the folder's). The recipe's eval
    set paths must be local. Of ``ctx`` the device, progress (as stage ``evaluate``),
    cancel and ``manifest_file`` apply."""
    from maec_core.eval.runner import evaluate_loaded

    ctx = ctx or RunContext()
    sets = load_sets(eval_spec(recipe))
    scoring = ctx.but(progress=_eval_progress(ctx.progress))
    models = {label: str(folder)}
    if recipe.evaluate_inputs:
        models.update(input_models(recipe))
    report = EvalReport(models=[evaluate_loaded(name, path, sets, scoring)
                                for name, path in models.items()])
    amended = attach_evaluation(folder, report, label=label, manifest=manifest,
                                write=ctx.manifest_file, names=ctx.names)
    return FolderEvaluation(report, amended.manifest, amended.added)


def _eval_progress(progress: ProgressFn | None) -> ProgressFn | None:
    if progress is None:
        return None
    report = progress

    def step(_where: str, done: int, total: int) -> None:
        report("evaluate", done, total)

    return step


@dataclass(frozen=True)
class SweepOptions:
    """What a sweep adds to a run's context.

    ``work_dir``: where the candidates' temporary folders go (default: beside the
    output). ``keep`` receives each candidate when ``publish: all``; ``announce`` each
    candidate as it starts. ``resident_budget``: bytes of memory a MAEC sweep may hold
    its language base (then ability vectors) in, to read them once for all candidates
    (None: half the available memory less the scoring model; 0: read them from disk
    for each candidate).
    """

    work_dir: Path | None = None
    keep: KeepFn | None = None
    announce: AnnounceFn | None = None
    resident_budget: int | None = None


def run_sweep(recipe: Recipe, out: Path, ctx: RunContext | None = None,
              sweep_options: SweepOptions | None = None) -> SweepResult:
    """Run every candidate of ``recipe.sweep`` and publish the winner in ``out`` with
    ``eval_report.json`` (every model, every item), ``leaderboard.json`` and
    ``sweep.png``.

    Without ``ctx.artifact_store`` ability vectors are kept in a temporary store for the
    sweep's duration. A sweep never replaces ``out`` (``ctx.overwrite`` is not used);
    ``ctx.options`` apply to every candidate's merge. Raises NoFeasibleCandidate when
    the constraint leaves none.
    """
    ctx = ctx or RunContext()
    opts = sweep_options or SweepOptions()
    started = time.perf_counter()
    out = Path(out)
    if out.exists():
        raise OutputExists(f"output folder {out} already exists", path=str(out))
    cands = candidates(recipe)
    parent = Path(opts.work_dir) if opts.work_dir is not None else out.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.sweep-", dir=parent))
    try:
        store = ctx.artifact_store or LocalArtifactStore(tmp / "art")
        sweep = _Sweep(recipe, cands, tmp, ctx.but(artifact_store=store), opts)
        board, report, best = sweep.run(opts.announce)
        from maec_core.sweep.plot import plot_png

        assert best.folder is not None
        folder = best.folder
        manifest = attach_evaluation(folder, report, label=board.winner or "", board=board,
                                     plot=plot_png(board), manifest=best.manifest,
                                     write=ctx.manifest_file, names=ctx.names).manifest
        folder.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return SweepResult(out, board, report, manifest, sweep.state.extractions,
                       time.perf_counter() - started)


class _CountingStore:
    """The sweep's artifact store, counting the ability vectors stored through it: a
    candidate whose merge stored one extracted it."""

    def __init__(self, inner: ArtifactStore) -> None:
        self.inner = inner
        self.puts = 0

    def get(self, key: str) -> Path | None:
        return self.inner.get(key)

    def put(self, key: str, folder: Path) -> None:
        self.inner.put(key, folder)
        self.puts += 1


class _Sweep:
    """One sweep's run: the candidates in grid order, the best so far remembered (kept
    on disk when candidates are written)."""

    def __init__(self, recipe: Recipe, cands: list[Candidate], tmp: Path, ctx: RunContext,
                 opts: SweepOptions) -> None:
        assert recipe.sweep is not None and ctx.artifact_store is not None
        self.recipe, self.spec, self.cands, self.tmp = recipe, recipe.sweep, cands, tmp
        self.store = _CountingStore(ctx.artifact_store)
        # Every candidate's merge runs in this context: into a fresh folder of its own.
        self.ctx = ctx.but(artifact_store=self.store, overwrite=False)
        # Scoring reports its progress as the ``evaluate`` stage.
        self.scoring = ctx.but(progress=_eval_progress(ctx.progress))
        self.keep = opts.keep if recipe.sweep.publish == "all" else None
        # A LoRA output is an adapter of the merge, not the merge a sink receives.
        lora = recipe.output is not None and recipe.output.format == "lora"
        self.in_memory = recipe.sweep.publish == "best" and not lora
        self.state = _State()
        self.resident_budget = opts.resident_budget
        self.memory: SweepMemory | None = None
        # Each extraction group's last candidate: its held ability vectors go after it.
        self.last_of: dict[Any, int] = {c.group: c.index for c in cands
                                        if c.group is not None}

    def _check_cancel(self) -> None:
        if self.ctx.cancelled():
            raise Cancelled("the sweep was cancelled")

    def run(self, announce: AnnounceFn | None) -> tuple[Leaderboard, EvalReport, _Best]:
        """Score the references, then each candidate; returns the board, the full
        report and the winner (its folder written)."""
        from maec_core.eval.runner import evaluate_loaded
        from maec_core.sweep.memory import SweepMemory
        from maec_core.sweep.scoring import ModelSlot

        sets = load_sets(eval_spec(self.recipe))
        dev = best_device(self.ctx.device)
        refs = self._references()
        inputs = [evaluate_loaded(label, path, sets, self.scoring)
                  for label, path in refs.items()]
        reference = {s.name: s.value for m in inputs if m.label == LANGUAGE_BASE
                     for s in m.sets}
        # After the references: their models are freed, so the memory available now is
        # what the candidates share.
        self.memory = SweepMemory.start(self.recipe, dev, self.resident_budget,
                                         self.ctx.cancel)
        try:
            self._score_candidates(sets, ModelSlot(dev), inputs, reference, announce)
            winner, why = rank(self.state.rows, self.spec, reference)
            best = self.state.best
            assert best is not None and best.cand.id == winner
            board = self._board(winner, why, reference)
            report = EvalReport(models=[*inputs, *self.state.results])
            if best.folder is None:
                best.folder = self.tmp / best.cand.id
                best.manifest = self._merge(best.cand, best.folder)
        finally:
            self.memory.close()
        return board, report, best

    def _score_candidates(self, sets: list[LoadedSet], slot: ModelSlot,
                          inputs: list[ModelResult], reference: dict[str, float],
                          announce: AnnounceFn | None) -> None:
        """Merge and score every candidate in grid order, in ``slot`` (closed after)."""
        try:
            for cand in self.cands:
                self._check_cancel()
                if announce is not None:
                    announce(cand.index, len(self.cands))
                self._candidate(cand, sets, slot, inputs, reference)
        finally:
            slot.close()
        if announce is not None:
            announce(len(self.cands), len(self.cands))

    def _references(self) -> dict[str, str]:
        """The inputs scored once: all of them with evaluate_inputs, else the language
        base when a ratio constraint compares against it."""
        models = input_models(self.recipe)
        if self.recipe.evaluate_inputs:
            return models
        c = self.spec.constraint
        if c is not None and c.reference == LANGUAGE_BASE and LANGUAGE_BASE in models:
            return {LANGUAGE_BASE: models[LANGUAGE_BASE]}
        return {}

    def _candidate(self, cand: Candidate, sets: list[LoadedSet], slot: ModelSlot,
                   inputs: list[ModelResult], reference: dict[str, float]) -> None:
        folder = self.tmp / cand.id
        t0 = time.perf_counter()
        puts = self.store.puts
        manifest: dict[str, Any] | None = None
        if self.in_memory:
            try:
                self._merge_in_memory(cand, folder, slot)
            except NamesDiffer:
                if slot.loaded is not None or self.state.rows:
                    raise  # the model was built for these names: a broken candidate
                # The architecture's checkpoint names are not its weights' (transformers
                # converts them at load, e.g. fused mixture-of-experts weights): no
                # candidate can be merged into the model by name, so each is written and
                # loaded, as a separate evaluation does (the slot loads them afresh).
                # The merge stopped before computing anything.
                self.in_memory = False
                manifest = self._merge(cand, folder)
        else:
            manifest = self._merge(cand, folder)
        written = not self.in_memory
        if written:
            slot.load(folder)
        # An extraction stores its ability vector, also in a merge retried above.
        extracted = self.store.puts > puts
        self.state.extractions += int(extracted)
        if self.memory is not None and cand.group is not None and (
                self.last_of[cand.group] == cand.index):
            self.memory.release_group(cand.group)  # no later candidate needs them
        self._check_cancel()
        # ``folder`` names the candidate in the report even when it was never written.
        result = slot.score(cand.id, str(folder), sets, self.scoring)
        self.state.results.append(result)
        report = EvalReport(models=[result])
        row = score_rows(report, [cand.id], {cand.id: cand.values}, self.spec, reference)[0]
        row.extracted = extracted
        row.seconds = time.perf_counter() - t0
        self.state.rows.append(row)
        if self.keep is not None:
            manifest = attach_evaluation(folder, EvalReport(models=[*inputs, result]),
                                         label=cand.id, manifest=manifest,
                                         write=self.ctx.manifest_file,
                                         names=self.ctx.names).manifest
            self.keep(cand, folder, manifest)
        self._keep_if_best(cand, row, folder if written else None, manifest)

    def _keep_if_best(self, cand: Candidate, row: Row, folder: Path | None,
                      manifest: dict[str, Any] | None = None) -> None:
        """Remember ``cand`` (and its ``folder``, if written) when it beats the best so
        far (the ranking's order, :func:`sort_key`); remove the loser's folder."""
        score = sort_key(row, self.spec, cand.index)
        best = self.state.best
        if row.feasible and not math.isnan(row.objective) and (best is None
                                                                or score < best.key):
            if best is not None and best.folder is not None:
                shutil.rmtree(best.folder, ignore_errors=True)
            self.state.best = _Best(score, cand, folder, manifest)
        elif folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    def _merge_in_memory(self, cand: Candidate, folder: Path, slot: ModelSlot) -> None:
        """Merge one candidate straight into the model in ``slot``; the first one
        builds that model, from the definition files its merge writes (no weights)."""
        if slot.loaded is not None:
            self._merge(cand, folder, sink=slot.sink)
            return
        skeleton = self.tmp / ".skeleton"
        try:
            self._merge(cand, folder, sink=functools.partial(slot.sink, skeleton=skeleton),
                        skeleton=skeleton)
        finally:
            shutil.rmtree(skeleton, ignore_errors=True)  # read once, as the model was built

    def _merge(self, cand: Candidate, folder: Path, sink: SinkFn | None = None,
               skeleton: Path | None = None) -> dict[str, Any]:
        """Merge one candidate into ``folder``, or into ``sink`` when given (no weights
        are written then; the definition files to ``skeleton`` when given); the
        folder's manifest."""
        from maec_core.run import run

        stored = self.state.groups.get(cand.group) if cand.group is not None else None
        resident = self.memory.resident(cand.group) if self.memory is not None else None
        ctx = self.ctx
        if sink is not None or resident is not None:
            ctx = ctx.but(options=dataclasses.replace(
                ctx.options, sink=sink, resident=resident, skeleton=skeleton))
        method = get_method(cand.recipe.merge_method)
        if stored is not None:
            return method.run_reusing(cand.recipe, stored, folder, ctx)
        result = run(cand.recipe, folder, ctx)
        if cand.group is None:
            return result.manifest
        made = method.made(result, self.store)
        if made is not None:
            self.state.groups[cand.group] = made
            if self.memory is not None and self.last_of[cand.group] > cand.index:
                self.memory.hold_group(cand.group, made.files)
        return result.manifest

    def _board(self, winner: str, why: str, reference: dict[str, float]) -> Leaderboard:
        c = self.spec.constraint
        constraint = None
        if c is not None:
            _sense, bound = c.limit(reference.get(c.set))
            constraint = {**c.model_dump(mode="json", exclude_none=True), "bound": bound,
                          "text": c.describe(reference.get(c.set))}
        return Leaderboard(
            knobs=list(self.spec.grid), rows=self.state.rows, winner=winner, why=why,
            objective=self.spec.objective.summary(),
            constraint=constraint, reference=reference,
            tie_break=None if self.spec.tie_break is None else self.spec.tie_break.summary(),
            extractions=self.state.extractions, publish=self.spec.publish,
            resident=self.memory.summary if self.memory is not None else None)
