"""MAEC end to end: extract each ability (or reuse its stored artifact), then combine.

Public entry points (``maec_core.run`` and the CLI call them, with a parsed recipe and
a :class:`~maec_core.context.RunContext`):
- ``run_maec(recipe, out_dir, ctx)``: the one-run merge; artifacts are looked up in and
  added to ``ctx.artifact_store`` by content-addressed key, when one is given.
- ``extract(recipe, ability_index, artifact_dir, ctx)``: stage 1 alone.
- ``combine(recipe, artifact_dirs, out_dir, ctx)``: stage 2 alone, from artifacts.
- ``artifact_key(recipe, ability_index)`` (from ``keys``): the key an artifact is stored under.
- ``report_cosines(report)``: the c_t a combination computed, for the next ``combine`` of
  the same checkpoints to reuse.

The report file (``maec_report.json``) holds only what the inputs determine, so a
one-run merge and extract-then-combine publish identical folders; run facts (seconds,
whether an artifact was reused) are added to ``MergeResult.report`` only.

``ctx.hash_cache`` everywhere is the folder where input-file digests are kept between
processes (None: remembered for this process only).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maec_core.artifact_store import ArtifactStore, LocalArtifactStore
from maec_core.context import OutputSpec, RunContext
from maec_core.errors import ArtifactMismatch, CheckpointError, MaecError, OutputExists
from maec_core.io.folder import ModelFolder, open_model_folder
from maec_core.maec.artifact import Artifact, check_compatible, load_artifact
from maec_core.maec.combine import (
    Combination,
    RowRemap,
    Selection,
    check_decided,
    fmt_cos,
    merge,
    select,
)
from maec_core.maec.extract import (
    AbilityInputs,
    ExtractResult,
    extract_ability,
    included_tensors,
)
from maec_core.maec.keys import (
    artifact_key,
    checkpoint_dtype,
    folder_checksums,
    key_document,
    key_of,
)
from maec_core.maec.params import (
    MaecParams,
    language_base_of,
    maec_inputs,
    validate_maec_recipe,
)
from maec_core.maec.records import Found, load_selection
from maec_core.maec.vocab import TokenMap, maec_token_map
from maec_core.plan import MergePlan, build_plan
from maec_core.recipe import Recipe
from maec_core.runtime import MergeResult, ProgressFn

__all__ = ["ArtifactStore", "LocalArtifactStore", "artifact_key", "combine", "extract",
           "report_cosines", "run_maec"]

BASE, LANG = "base_model", "language_base"
REPORT_NAME = "maec_report.json"
REPORT_VERSION = 1


def _params(recipe: Recipe) -> MaecParams:
    if recipe.merge_method != "maec":
        raise CheckpointError(f"recipe merge_method is {recipe.merge_method!r}, not 'maec'")
    return validate_maec_recipe(recipe)


def _ability_folders(recipe: Recipe, i: int) -> tuple[ModelFolder, ModelFolder | None]:
    ab = maec_inputs(recipe).abilities[i]
    # A LoRA adapter donor (or control) applies to θ0, the recipe's base model.
    base = recipe.base_model
    return (open_model_folder(ab.model, base=base),
            open_model_folder(ab.control, base=base) if ab.control else None)


def _passes(params: MaecParams) -> int:
    return 2 if params.importance == "gradient" or params.rank_scope == "global" else 1


def _counter(progress: ProgressFn | None, stage: str, total: int) -> Callable[[], None]:
    """A step callback reporting ``stage`` progress out of ``total`` steps; the stage is
    announced at 0 at once, so a caller watching sees it start (a gradient extraction's
    corpus pass comes before its first step) rather than the stage before it."""
    done = [0]
    if progress is not None and total:
        progress(stage, 0, total)

    def tick() -> None:
        done[0] += 1
        if progress is not None:
            progress(stage, done[0], total)

    return tick


def extract(recipe: Recipe, ability_index: int, artifact_dir: str | Path,
            ctx: RunContext | None = None) -> ExtractResult:
    """Extract ability ``ability_index`` of ``recipe`` into the folder ``artifact_dir``."""
    ctx = ctx or RunContext()
    params = _params(recipe)
    if not 0 <= ability_index < len(maec_inputs(recipe).abilities):
        raise CheckpointError(
            f"ability index {ability_index} is out of range: the recipe has "
            f"{len(maec_inputs(recipe).abilities)} abilities"
        )
    assert recipe.base_model is not None
    base = open_model_folder(recipe.base_model)
    plan_tensors = build_plan({BASE: base}, BASE).tensors
    total = _passes(params) * len(included_tensors(params, plan_tensors))
    ability, control = _ability_folders(recipe, ability_index)
    corpus = maec_inputs(recipe).abilities[ability_index].corpus
    doc = key_document(params, base, ability, control, corpus, ctx.hash_cache,
                       ctx.artifact_scope)
    return extract_ability(params, doc, AbilityInputs(base, ability, control, corpus),
                           Path(artifact_dir), ctx, _counter(ctx.progress, "extract", total))


@dataclass
class _Found:
    """The artifact folders a combination reads, one per ability, and how they came:
    whether each was reused (not extracted by this run), the seconds extraction took,
    and when the run started (``perf_counter``; None: when combination starts)."""

    dirs: list[Path]
    reused: list[bool]
    extract_seconds: float = 0.0
    started: float | None = None


def combine(
    recipe: Recipe,
    artifact_dirs: Sequence[str | Path],
    out_dir: str | Path,
    ctx: RunContext | None = None,
    *,
    cosines: Mapping[str, Mapping[str, float]] | None = None,
) -> MergeResult:
    """Combine stored artifacts (one per ability, in recipe order) into θL.

    ``cosines`` (artifact key -> tensor -> c_t; :func:`report_cosines` of an earlier
    combination of the same checkpoints) spares computing c_t again: a sweep over μ or
    the selection parameters computes them once."""
    params = _params(recipe)
    if len(artifact_dirs) != len(maec_inputs(recipe).abilities):
        raise CheckpointError(
            f"combine needs one artifact per ability: the recipe has "
            f"{len(maec_inputs(recipe).abilities)}, got {len(artifact_dirs)}"
        )
    found = _Found([Path(d) for d in artifact_dirs], [True] * len(artifact_dirs))
    return _combine(recipe, params, found, Path(out_dir), ctx or RunContext(), cosines)


def run_maec(recipe: Recipe, out_dir: str | Path, ctx: RunContext | None = None
             ) -> MergeResult:
    """The full MAEC merge: extraction (or artifact reuse) then combination.

    Artifacts are looked up in and added to ``ctx.artifact_store``; without one, every
    ability is extracted into a temporary folder that is removed afterwards.
    """
    ctx = ctx or RunContext()
    started = time.perf_counter()
    params = _params(recipe)
    assert recipe.base_model is not None
    out = Path(out_dir)
    if out.exists() and not ctx.overwrite:
        # Before minutes of extraction, not after.
        raise OutputExists(f"output folder {out} already exists", path=str(out))
    stored = maec_inputs(recipe).artifact
    if stored is not None:
        return _combine(recipe, params, _Found([Path(stored)], [True]), out, ctx)
    if ctx.options.phase_records:
        # One part (or the final step) of a split merge: the ability vectors and the
        # selection were decided before it, once (maec_core.maec.phases).
        before, selection = from_records(ctx.options.phase_records)
        dirs = stored_artifacts(before.keys, ctx)
        return _combine(recipe, params, _Found(dirs, before.reused, before.extract_seconds),
                        out, ctx, decided=selection)
    tmp: Path | None = None
    try:
        dirs, reused, tmp, cosines, _ = _abilities(recipe, params, out, ctx)
        found = _Found(dirs, reused, time.perf_counter() - started, started)
        return _combine(recipe, params, found, out, ctx, cosines)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _abilities(recipe: Recipe, params: MaecParams, out: Path, ctx: RunContext
               ) -> tuple[list[Path], list[bool], Path | None, dict[str, dict[str, float]],
                          list[str]]:
    """Each ability's artifact folder, reused from ``ctx.artifact_store`` or extracted
    now (into a temporary folder beside ``out``, returned for the caller to remove);
    whether each was reused; the c_t the extractions computed on the way (artifact
    key -> tensor -> c_t); and each ability's artifact key."""
    store, hash_cache = ctx.artifact_store, ctx.hash_cache
    assert recipe.base_model is not None
    base = open_model_folder(recipe.base_model)
    lang = open_model_folder(language_base_of(recipe), base=recipe.base_model)
    folders = {BASE: base, LANG: lang}
    entries = maec_inputs(recipe).abilities
    abilities = [_ability_folders(recipe, i) for i in range(len(entries))]
    for i, (ability, control) in enumerate(abilities):
        folders[f"abilities[{i}].model"] = ability
        if control is not None:
            folders[f"abilities[{i}].control"] = control
    # Every checkpoint agrees on names, shapes and dtypes before any tensor is read
    # (the vocabulary rows may differ when the language base extends θ0's tokenizer).
    tmap = maec_token_map(recipe, base, folders[LANG],
                          [f for ab in abilities for f in ab if f is not None])
    plan = build_plan(folders, LANG, tmap.lang_rows if tmap else None)
    docs = [key_document(params, base, ability, control, entries[i].corpus,
                         hash_cache, ctx.artifact_scope)
            for i, (ability, control) in enumerate(abilities)]
    keys = [key_of(doc) for doc in docs]
    found = [store.get(k) if store is not None else None for k in keys]
    # Two abilities with the same donor and parameters share one key: extract it once.
    todo = {keys[i] for i, f in enumerate(found) if f is None}
    total = _passes(params) * len(included_tensors(params, plan.tensors)) * len(todo)
    tick = _counter(ctx.progress, "extract", total)
    if todo:
        # The scratch folder sits beside the output, whose parents may not exist yet.
        out.parent.mkdir(parents=True, exist_ok=True)
    tmp = (Path(tempfile.mkdtemp(prefix=f".{out.name}.extract-", dir=out.parent))
           if todo else None)
    dirs: list[Path] = []
    made: dict[str, Path] = {}
    cosines: dict[str, dict[str, float]] = {}
    # The key rows extraction reads give c_t against θL too, unless the vocabulary rows
    # move between θ0 and θL (selection then maps them).
    language = folders[LANG] if tmap is None else None
    try:
        for i, (ability, control) in enumerate(abilities):
            hit = found[i] or made.get(keys[i])
            if hit is None:
                assert tmp is not None
                inputs = AbilityInputs(base, ability, control, entries[i].corpus,
                                       language)
                # A fresh folder in the scratch one: nothing there to overwrite.
                result = extract_ability(params, docs[i], inputs, tmp / keys[i],
                                         ctx.but(overwrite=False), tick)
                hit = result.folder
                cosines[keys[i]] = result.cosines
                if store is not None:
                    store.put(keys[i], hit)
                made[keys[i]] = hit
            dirs.append(hit)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dirs, [f is not None for f in found], tmp, cosines, keys


def find_or_extract(recipe: Recipe, workdir: Path, ctx: RunContext) -> Found:
    """Every ability's artifact in ``ctx.artifact_store``: reused, or extracted now (in
    a scratch folder under ``workdir``, removed after) and put there; what was found."""
    if ctx.artifact_store is None:
        raise MaecError("a MAEC merge split into parts keeps its ability vectors in an "
                        "artifact store, and none was given")
    started = time.perf_counter()
    params = _params(recipe)
    workdir.mkdir(parents=True, exist_ok=True)
    tmp: Path | None = None
    try:
        _, reused, tmp, _, keys = _abilities(recipe, params, workdir / "out", ctx)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return Found(keys, reused, time.perf_counter() - started)


def stored_artifacts(keys: Sequence[str], ctx: RunContext) -> list[Path]:
    """The folders of the stored artifacts ``keys`` (a split merge's: extracted or found
    before its parts)."""
    store = ctx.artifact_store
    dirs = [store.get(k) if store is not None else None for k in keys]
    missing = [k for k, d in zip(keys, dirs, strict=True) if d is None]
    if missing:
        raise ArtifactMismatch(f"the ability vector {missing[0][:16]} this split merge "
                               "found before its parts is gone from the artifact store")
    return [d for d in dirs if d is not None]


def from_records(records: Sequence[str]) -> tuple[Found, Selection]:
    """A split merge's records: the ability vectors found, and the selection made."""
    if len(records) != 2:
        raise ArtifactMismatch(f"a split MAEC merge has 2 records before it combines, "
                               f"got {len(records)}")
    return Found.load(records[0]), load_selection(records[1])


@dataclass(frozen=True)
class _Inputs:
    """What a combination reads: the output's plan (θ0 and θL), the checked artifacts
    and the token map between θ0's and θL's vocabularies (None: the same)."""

    plan: MergePlan
    artifacts: list[Artifact]
    tmap: TokenMap | None

    @property
    def remap(self) -> RowRemap | None:
        return RowRemap(self.tmap) if self.tmap else None


def _output_plan(recipe: Recipe) -> MergePlan:
    """The combination's plan: θ0 and θL, the output's tensors θL's (from headers)."""
    return _planned(recipe)[0]


def _planned(recipe: Recipe) -> tuple[MergePlan, TokenMap | None, ModelFolder]:
    assert recipe.base_model is not None
    base = open_model_folder(recipe.base_model)
    lang = open_model_folder(language_base_of(recipe), base=recipe.base_model)
    tmap = maec_token_map(recipe, base, lang, [])
    plan = build_plan({BASE: base, LANG: lang}, LANG, tmap.lang_rows if tmap else None)
    return plan, tmap, base


def _inputs(recipe: Recipe, params: MaecParams, found: _Found, hash_cache: Path | None
            ) -> _Inputs:
    plan, tmap, base = _planned(recipe)
    # Artifacts are in θ0's coordinates (its vocabulary rows): checked against θ0's shapes.
    artifacts = _checked_artifacts(params, base, build_plan({BASE: base}, BASE) if tmap
                                   else plan, found.dirs, found.reused, hash_cache)
    return _Inputs(plan, artifacts, tmap)


def _combine(
    recipe: Recipe,
    params: MaecParams,
    found: _Found,
    out_dir: Path,
    ctx: RunContext,
    cosines: Mapping[str, Mapping[str, float]] | None = None,
    decided: Selection | None = None,
) -> MergeResult:
    """Combination; ``decided``: the selection made already (a split merge's, from the
    c_t its parts measured), applied as given."""
    t0 = time.perf_counter()
    started = found.started if found.started is not None else t0
    reused, extract_seconds, progress = found.reused, found.extract_seconds, ctx.progress
    assert recipe.base_model is not None
    inputs = _inputs(recipe, params, found, ctx.hash_cache)
    plan, artifacts, tmap, remap = inputs.plan, inputs.artifacts, inputs.tmap, inputs.remap
    n_sel = 0 if decided is not None else sum(len(a.tensors) for a in artifacts)
    total = n_sel + len(plan.tensors)

    def sel_step(done: int, _total: int) -> None:
        if progress is not None:
            progress("combine", done, total)

    if decided is not None:
        check_decided(decided, artifacts)
        selection = decided
    else:
        selection = select(params, plan, artifacts, ctx, keys=(BASE, LANG), step=sel_step,
                           remap=remap, known=cosines)
    select_seconds = time.perf_counter() - t0
    report = build_report(recipe, params, plan, artifacts, selection)
    if tmap is not None:
        report["vocabulary"] = tmap.report()
    entries = maec_inputs(recipe).abilities
    mus = [ab.mu for ab in entries]

    def merge_progress(stage: str, done: int, _total: int) -> None:
        if progress is not None:
            progress("combine", n_sel + done, total)

    # The published recipe spells out every MAEC default, so the merge can be redone
    # exactly even if a default changes later.
    filled = {k: v for k, v in params.model_dump(mode="json").items() if v is not None}
    recorded = recipe.model_copy(update={"parameters": filled})
    t1 = time.perf_counter()
    output = OutputSpec(
        out_dir, recorded, recipe.dtype or plan.input_dtype, LANG,
        [language_base_of(recipe), recipe.base_model, *[ab.model for ab in entries]],
        extra_json={REPORT_NAME: report}, card_summary=card_summary(report),
        manifest_extra={"maec": {"artifact_keys": report["artifact_keys"]}})
    combination = Combination(artifacts, selection, mus, LANG, remap,
                              [ab.control is not None for ab in entries])
    result = merge(plan, combination, output,
                   ctx.but(progress=merge_progress))
    now = time.perf_counter()
    seconds = {"extract": extract_seconds, "select": select_seconds,
               "combine": now - t0, "merge": now - t1, "total": now - started}
    runtime = dict(report)
    runtime["abilities"] = [dict(a, artifact_reused=reused[i])
                            for i, a in enumerate(report["abilities"])]
    runtime["seconds"] = seconds
    result.report = runtime
    result.stage_seconds = {"extract": extract_seconds, "combine": now - t0}
    result.seconds = now - started
    return result


def _checked_artifacts(params: MaecParams, base: ModelFolder, base_plan: MergePlan,
                       artifact_dirs: list[Path], reused: list[bool],
                       hash_cache: Path | None) -> list[Artifact]:
    """The artifacts, each checked against θ0 (checksums, dtype, shapes in
    ``base_plan``) and the parameters."""
    base_sums = folder_checksums(base, hash_cache)
    ckpt_dtype = checkpoint_dtype(base)
    by_name = {t.name: t for t in base_plan.tensors}
    # A store's or a caller's artifact is hashed against its metadata; one this run just
    # wrote (not reused) was hashed as it was written.
    artifacts = [load_artifact(d, verify=reused[i], hash_cache=hash_cache)
                 for i, d in enumerate(artifact_dirs)]
    for i, art in enumerate(artifacts):
        check_compatible(art, base_checksums=base_sums, params=params,
                         checkpoint_dtype=ckpt_dtype, tensors=by_name,
                         label=f"abilities[{i}]")
    return artifacts


def build_report(recipe: Recipe, params: MaecParams, plan: MergePlan,
                 artifacts: list[Artifact], selection: Selection) -> dict[str, Any]:
    """The job report: every c_t and decision, per-tensor key rows and score statistics."""
    tensors: list[dict[str, Any]] = []
    for t in plan.tensors:
        per: list[dict[str, Any]] = []
        for k, art in enumerate(artifacts):
            at = art.tensors.get(t.name)
            if at is None:
                continue
            per.append({
                "ability": k,
                "candidates": at.candidates,
                "key_rows": at.kept,
                "score": at.score,
                "c_t": selection.cosines[k][t.name],
                "kept": t.name in selection.kept[k],
            })
        if per:
            tensors.append({"name": t.name, "shape": list(t.shape), "abilities": per})
    abilities = []
    changed: set[str] = set()
    for k, (ab, art) in enumerate(zip(maec_inputs(recipe).abilities, artifacts, strict=True)):
        kept = selection.kept[k]
        if ab.mu != 0.0:
            changed |= kept
        abilities.append({
            "index": k,
            "name": ab.name or f"ability{k}",
            "model": ab.model,
            "control": ab.control,
            "mu": ab.mu,
            "artifact_key": art.key,
            "tensors_carrying": len(art.tensors),
            "tensors_kept": len(kept),
            "tensors_dropped": sorted(set(art.tensors) - kept),
            "key_rows": sum(a.kept for a in art.tensors.values()),
            "key_rows_kept": sum(art.tensors[n].kept for n in kept),
            "weights_added": sum(
                e["kept"] * e["row_width"] for e in art.meta["tensors"] if e["name"] in kept
            ),
            "gradient": art.meta.get("gradient"),
        })
    return {
        "method": "maec",
        "report_version": REPORT_VERSION,
        "parameters": params.model_dump(mode="json"),
        "artifact_keys": [a.key for a in artifacts],
        "abilities": abilities,
        "tensors": tensors,
        "totals": {
            "tensors": len(plan.tensors),
            "tensors_carrying": len(tensors),
            "tensors_changed": len(changed),
            "weights": sum(t.numel for t in plan.tensors),
        },
    }


def report_cosines(report: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """c_t by artifact key and tensor, read back from a combination's report (what
    :func:`combine` takes as ``cosines``)."""
    keys = [a["artifact_key"] for a in report["abilities"]]
    out: dict[str, dict[str, float]] = {k: {} for k in keys}
    for t in report["tensors"]:
        for e in t["abilities"]:
            out[keys[e["ability"]]][t["name"]] = e["c_t"]
    return out


def card_summary(report: dict[str, Any]) -> str:
    """The model card's MAEC section, from the report."""
    p = report["parameters"]
    lines = [
        "## MAEC",
        "",
        f"Ability vectors were extracted with importance `{p['importance']}`, granularity "
        f"`{p['granularity']}`, key_ratio {p['key_ratio']} ({p['rank_scope']} ranking), and "
        f"added to the language base where their key-row update is least aligned with the "
        f"language update (selection `{p['selection']}`: "
        + (f"ratio {p['selection_ratio']}" if p["selection"] == "ratio"
           else f"|c_t| <= {p['selection_threshold']}") + ").",
        "",
        "| ability | μ | tensors kept / carrying | key rows kept | artifact |",
        "|---|---|---|---|---|",
    ]
    for a in report["abilities"]:
        lines.append(f"| {a['name']} | {a['mu']} | {a['tensors_kept']} / "
                     f"{a['tensors_carrying']} | {a['key_rows_kept']} | "
                     f"`{a['artifact_key'][:16]}` |")
    dropped = [(abs(e["c_t"]), t["name"], e["c_t"], e["ability"]) for t in report["tensors"]
               for e in t["abilities"] if not e["kept"]]
    if dropped:
        dropped.sort(key=lambda d: (-d[0], d[1]))
        lines += ["", "Most language-entangled tensors left out (highest |c_t|):", ""]
        for _, name, c, k in dropped[:10]:
            lines.append(f"- `{name}` (ability {k}): c_t = {fmt_cos(c)}")
    totals = report["totals"]
    lines += ["", f"{totals['tensors_changed']} of {totals['tensors']} tensors differ from the "
              "language base; every c_t and decision is in `maec_report.json`."]
    return "\n".join(lines)
