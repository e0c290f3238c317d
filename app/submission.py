"""A job request, turned into a recipe and checked before anything is queued.

Two body forms (docs/api.md): named checkpoints (``method`` + donors + language base) or a
recipe. Both end as one ``maec_core`` Recipe whose model names are source strings; every
source is then allow-listed, resolved and its headers compared (no weights are read).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from app.scheduler.estimate import Need, estimate, estimate_gguf_job
from app.settings import Settings
from app.sources import (
    GgufSource,
    Published,
    Source,
    check_corpus,
    check_gguf,
    inspect_source,
    open_source,
    parse_source,
    pin_source,
)
from app.storage.base import Storage, StorageError
from maec_contract import JobRequest as JobRequest  # the body model, shared with the client
from maec_core.service import (
    LOSSY_WARNING,
    SET_MAX_BYTES,
    Condition,
    EmptySelection,
    EvalSetError,
    EvalSetUnreadable,
    JobPlan,
    Joined,
    LmEvalConfig,
    MergePlan,
    ModelFolder,
    NamedForm,
    ParamValue,
    Recipe,
    RecipeError,
    SourceNotFound,
    TensorMethod,
    candidates,
    check_lm_eval_sets,
    check_output,
    check_type,
    get_method,
    load_set,
    parse_recipe,
    plan_job,
    plan_recipe,
)


def build_recipe(req: JobRequest) -> Recipe:
    """The recipe the job runs (RecipeError on any problem a recipe can have)."""
    if req.recipe is not None:
        data = _with_evaluation(dict(req.recipe), req)
        if req.name is not None and "name" not in data:
            data["name"] = req.name
        recipe = parse_recipe(data)
    else:
        recipe = _named_recipe(req)
    get_method(recipe.merge_method).check_service(recipe)
    if recipe.sweep is not None:
        candidates(recipe)  # every candidate checked as a recipe, before queueing
    return recipe


# Keys either body form may carry beside the merge; they are the recipe's own keys, so a
# recipe and a named body spell them the same way.
_BODY_RECIPE_KEYS = ("evaluate", "evaluate_inputs", "sweep", "output")


def _with_evaluation(data: dict[str, Any], req: JobRequest) -> dict[str, Any]:
    """The body's evaluate / evaluate_inputs / sweep / output, put into the recipe data
    (a recipe may carry them itself, but not both)."""
    for key in _BODY_RECIPE_KEYS:
        value = getattr(req, key)
        if value is None:
            continue
        if key in data:
            raise RecipeError(f"{key} is given both in the body and in the recipe",
                              key=key)
        data[key] = value
    return data


def _named_recipe(req: JobRequest) -> Recipe:
    # Checked by the model validator; empty strings are refused later as invalid_source.
    assert req.method is not None and req.ability_donor is not None
    assert req.language_base is not None
    form = NamedForm.of(req)
    # The method decides where each named checkpoint and parameter goes.
    data = get_method(req.method.strip().lower()).named_form(form)
    data.update({"dtype": req.dtype, "name": req.name})
    if req.shard_size is not None:
        data["out_shard_size"] = req.shard_size
    return parse_recipe(_with_evaluation(data, req))


def check_tokenizer_source(plan: JobPlan) -> None:
    """Every tokenizer reference names one of the checkpoints the job reads (or a
    keyword), but a models recipe's tokenizer source, which may name a tokenizer donor
    (an input of its own, as in mergekit)."""
    named = {*plan.checkpoints, *(j.ref for j in plan.joined)}
    donors = set() if plan.recipe.layered else set(plan.tokenizers)
    if any(s.kind == "tokenizer" and s.ref not in named and s.ref not in donors
           for s in plan.recipe.sources()):
        raise RecipeError("tokenizer_source must be 'base', 'union' or one of the recipe's "
                          "models (a tokenizer donor: in a models recipe)",
                          key="tokenizer_source")


def inspect_models(plan: JobPlan, parsed: dict[str, Source], storage: Storage
                   ) -> dict[str, ModelFolder]:
    """Header views of every checkpoint the recipe reads, the recipe's base first: a LoRA
    adapter among the others applies to that base, its shapes checked against the base's
    headers. The base an adapter's own config names is never followed (it may lie
    outside every allowed root), so an adapter with no base in the recipe, or as the
    base itself, is refused."""
    recipe = plan.recipe
    # Tokenizer files are read only for a recipe that merges vocabularies.
    tokenizer = recipe.vocab_source is not None
    folders: dict[str, ModelFolder] = {}
    base_ref = recipe.base_model
    if base_ref is not None and base_ref in parsed:
        folders[base_ref] = inspect_source(parsed[base_ref], storage, tokenizer)
    base = folders.get(base_ref) if base_ref is not None else None
    # A base+adapter reference's adapter is opened only on the base it names.
    own = {j.adapter for j in plan.joined}
    for uri in plan.checkpoints:
        if uri not in folders and uri not in own:
            folders[uri] = inspect_source(parsed[uri], storage, tokenizer, base=base)
    for j in plan.joined:
        folders[j.ref] = _joined(j, inspect_source(parsed[j.adapter], storage, tokenizer,
                                                   base=folders[j.base]), folders[j.base])
    for uri in plan.tokenizers:
        folders[uri] = inspect_source(parsed[uri], storage, True)
    return folders


def _joined(j: Joined, adapter: ModelFolder, base: ModelFolder) -> ModelFolder:
    """``adapter`` (opened on ``base``) when it is an adapter of a full checkpoint."""
    if base.base is not None or adapter.base is None:
        raise j.refused()
    return adapter


def check_sources(
    recipe: Recipe, settings: Settings, storage: Storage,
    outputs: Mapping[str, Published] | None = None,
) -> dict[str, dict[str, Any]]:
    """Allow-list, resolve and compare every source; returns ``{uri: source dict}``,
    each pinned to the files it holds now (what the worker will fetch, and nothing else).

    Blocking (file and S3 I/O): the API calls it in a worker thread.
    """
    return check_and_estimate(recipe, settings, storage, outputs)[0]


def check_and_estimate(
    recipe: Recipe, settings: Settings, storage: Storage,
    outputs: Mapping[str, Published] | None = None,
) -> tuple[dict[str, dict[str, Any]], Need, list[str]]:
    """:func:`check_sources`, and the job's needs estimated from the same headers
    (:mod:`app.scheduler.estimate`), which route it to a pool."""
    # What the job reads, as the worker's plan will say: the same plan, made here.
    plan = plan_job(recipe)
    check_tokenizer_source(plan)
    if len(plan.checkpoints) > settings.max_models_per_job:
        raise RecipeError(
            f"the job names {len(plan.checkpoints)} checkpoints; this service takes "
            f"at most {settings.max_models_per_job} (MAEC_MAX_MODELS_PER_JOB)",
            limit=settings.max_models_per_job,
        )
    parsed: dict[str, Source] = {}
    for uri in [*plan.checkpoints, *plan.tokenizers, *plan.corpora]:
        parsed[uri] = parse_source(uri, settings, outputs)
    ggufs = {uri: g for uri in plan.checkpoints
             if (g := check_gguf(parsed[uri], storage)) is not None}
    if ggufs:
        return _gguf_job(recipe, plan, parsed, ggufs, settings, storage, outputs)
    folders = inspect_models(plan, parsed, storage)
    merge_plan = plan_recipe(recipe, folders)
    check_against_plan(recipe, merge_plan)
    _check_gguf_output(recipe, folders)
    # Pinned after the checks: a file replaced in between is pinned as replaced, which
    # lets nothing unchecked through (the engine validates the folder it reads).
    pinned = {uri: pin_source(parsed[uri], storage)
              for uri in (*plan.checkpoints, *plan.tokenizers)}
    for uri in plan.corpora:
        pinned[uri] = check_corpus(parsed[uri], storage, settings.max_corpus_bytes)
    check_lm_eval_sets(recipe.evaluate or [], lm_eval_config(settings))
    pinned.update(check_eval_sets(plan, settings, storage, outputs))
    sources = {uri: s.to_dict() for uri, s in pinned.items()}
    return sources, estimate(recipe, merge_plan, sources), list(merge_plan.notes)


def _check_gguf_output(recipe: Recipe, folders: Mapping[str, ModelFolder]) -> None:
    """A GGUF output the writer cannot make (its type, the base's architecture) is
    refused before the job is queued."""
    if recipe.output is None or recipe.output.gguf is None:
        return
    check_type(recipe.output.gguf)
    first = folders.get(recipe.base_model or "") or next(iter(folders.values()), None)
    if first is not None:
        check_output(first.config)


def _gguf_job(recipe: Recipe, plan: JobPlan, parsed: dict[str, Source],
              ggufs: Mapping[str, GgufSource], settings: Settings, storage: Storage,
              outputs: Mapping[str, Published] | None
              ) -> tuple[dict[str, dict[str, Any]], Need, list[str]]:
    """:func:`check_and_estimate` for a job with GGUF inputs: their headers checked and
    their files pinned here; the other sources pinned as usual. The merge plan (names,
    shapes, the recipe's filters) is the worker's to check, on the dequantized folders:
    a mismatch fails the job with the same code it would get here."""
    if recipe.output is not None and recipe.output.gguf is not None:
        check_type(recipe.output.gguf)
    pinned = {uri: g.source for uri, g in ggufs.items()}
    for uri in (*plan.checkpoints, *plan.tokenizers):
        if uri not in pinned:
            pinned[uri] = pin_source(parsed[uri], storage)
    for uri in plan.corpora:
        pinned[uri] = check_corpus(parsed[uri], storage, settings.max_corpus_bytes)
    check_lm_eval_sets(recipe.evaluate or [], lm_eval_config(settings))
    pinned.update(check_eval_sets(plan, settings, storage, outputs))
    sources = {uri: s.to_dict() for uri, s in pinned.items()}
    need = estimate_gguf_job(recipe, [g.header.parameters for g in ggufs.values()], sources)
    notes = [LOSSY_WARNING.format(source=uri, quantization=g.header.quantization)
             for uri, g in ggufs.items()]
    return sources, need, notes


def lm_eval_config(settings: Settings) -> LmEvalConfig:
    """The settings lm_eval sets are checked with (the worker reads the same variables)."""
    dirs = tuple(Path(p) for p in settings.lm_eval_task_dirs.split(os.pathsep) if p)
    return LmEvalConfig(task_dirs=dirs, data_dir=Path(settings.lm_eval_data_dir)
                        if settings.lm_eval_data_dir else None, hub=settings.lm_eval_hub)


def check_eval_sets(plan: JobPlan, settings: Settings, storage: Storage,
                    outputs: Mapping[str, Published] | None = None) -> dict[str, Source]:
    """Allow-list every eval set (and few-shot file), pin it, and read it through its
    source kind, checking caps and every line as the worker will (EvalSetError with the
    file and line; EvalSetUnreadable when it cannot be read). Returns ``{uri: pinned}``."""
    parsed = {uri: parse_source(uri, settings, outputs) for uri in plan.eval_inputs}
    pinned: dict[str, Source] = {}
    if not parsed:
        return pinned
    with tempfile.TemporaryDirectory(prefix="maec-evalsets-") as tmp:
        local: dict[str, str] = {}
        for i, (uri, src) in enumerate(parsed.items()):
            pinned[uri], path = _eval_file(src, storage, Path(tmp) / str(i))
            local[uri] = str(path)
        for spec in plan.localised(local).evaluate or []:
            load_set(spec)
    return pinned


def _eval_file(source: Source, storage: Storage, dest: Path) -> tuple[Source, Path]:
    """``source`` pinned to its one file, and a local copy of exactly that file."""
    reader = open_source(source, storage)
    try:
        pinned = pin_source(source, storage, single=True)
    except SourceNotFound as exc:
        raise EvalSetUnreadable(f"eval set {source.uri}: {exc.message}",
                                source=source.uri) from None
    file = pinned.files[0]
    if file.size > SET_MAX_BYTES:
        raise EvalSetError(f"eval set {source.uri} is {file.size} bytes, above the "
                           f"{SET_MAX_BYTES} byte cap", source=source.uri, bytes=file.size)
    dest.mkdir(parents=True)
    try:
        reader.fetch(file, dest / file.name)
    except StorageError as exc:
        raise EvalSetUnreadable(f"eval set {source.uri}: {exc.message}",
                                source=source.uri) from None
    return pinned, dest / file.name


def check_against_plan(recipe: Recipe, plan: MergePlan) -> None:
    """What the worker will derive from the tensor names, derived now from the headers.

    MAEC: every include pattern matches a tensor and the selection is not empty. Tensor
    methods: every condition's filter matches a tensor, and the parameters resolved for
    each tensor (conditions, layer gradients) pass the method's models, as the engine
    will validate them. Raises EmptySelection or RecipeError.
    """
    method = get_method(recipe.merge_method)
    # The method's own checks (MAEC's selection); the rest applies to tensor methods.
    method.check_plan(recipe, ((t.name, len(t.shape)) for t in plan.tensors))
    if not isinstance(method, TensorMethod):
        return
    # Output names, and for a slices recipe the input names its sources are read under.
    names = sorted({t.name for t in plan.tensors}
                   | {i.name for t in plan.tensors for i in t.sources.values()})
    for where, params, _ in recipe.parameter_blocks():
        _check_filters(where, params, names)
    if recipe.layered:
        return  # resolved per slice by maec_core.slices, which names its own failures
    entries = method.merged_entries(recipe)
    for name in (t.name for t in plan.tensors):
        # The engine's own resolution (a model's value, else the recipe's default).
        try:
            method.resolve_models(recipe, entries, name, plan.num_layers)
        except RecipeError as exc:
            raise RecipeError(f"parameters: {exc.message}", **exc.details) from None


def _check_filters(where: str, params: Mapping[str, ParamValue], names: list[str]) -> None:
    for key, value in params.items():
        conditions = value if isinstance(value, list) else []
        for cond in conditions:
            if not isinstance(cond, Condition) or cond.filter in (None, "*"):
                continue
            if not any(cond.filter in name for name in names):
                raise EmptySelection(
                    f"{where}.{key}: filter {cond.filter!r} matches no tensor of the "
                    "checkpoints", parameter=key, filter=cond.filter,
                )
