"""A job request, turned into a recipe and checked before anything is queued.

Two body forms (docs/api.md): named checkpoints (``method`` + donors + language base) or a
recipe. Both end as one ``maec_core`` Recipe whose model names are source strings; every
source is then allow-listed, resolved and its headers compared (no weights are read).
"""

from __future__ import annotations

from typing import Any

from app.settings import Settings
from app.sources import Source, check_corpus, inspect_source, parse_source, pin_source
from app.storage.base import Storage
from maec_contract import JobRequest as JobRequest  # the body model, shared with the client
from maec_core.errors import RecipeError
from maec_core.io.folder import ModelFolder
from maec_core.methods import NamedForm, get_method
from maec_core.plan import plan_recipe
from maec_core.recipe import Recipe, parse_recipe


def build_recipe(req: JobRequest) -> Recipe:
    """The recipe the job runs (RecipeError on any problem a recipe can have)."""
    if req.recipe is not None:
        data = dict(req.recipe)
        if req.name is not None and "name" not in data:
            data["name"] = req.name
        recipe = parse_recipe(data)
    else:
        recipe = _named_recipe(req)
    if recipe.artifact is not None:
        raise RecipeError("recipe.artifact is not accepted by the service: ability vectors "
                          "are cached and reused automatically by content", key="artifact")
    return recipe


def _named_recipe(req: JobRequest) -> Recipe:
    # Checked by the model validator; empty strings are refused later as invalid_source.
    assert req.method is not None and req.ability_donor is not None
    assert req.language_base is not None
    form = NamedForm(
        base=req.base, ability_donor=req.ability_donor, language_base=req.language_base,
        source_control=req.source_control, ability_corpus=req.ability_corpus,
        parameters=dict(req.parameters or {}),
    )
    # The method decides where each named checkpoint and parameter goes.
    data = get_method(req.method.strip().lower()).named_form(form)
    data.update({"dtype": req.dtype, "name": req.name})
    if req.shard_size is not None:
        data["out_shard_size"] = req.shard_size
    return parse_recipe(data)


def model_sources(recipe: Recipe) -> list[str]:
    """Every checkpoint the recipe reads, reference (base) first, no repeats."""
    refs = recipe.sources()
    out = list(dict.fromkeys(s.ref for s in refs if s.kind == "checkpoint"))
    if any(s.kind == "tokenizer" and s.ref not in out for s in refs):
        raise RecipeError("tokenizer_source must be 'base', 'union' or one of the recipe's "
                          "models", key="tokenizer_source")
    return out


def corpus_sources(recipe: Recipe) -> list[str]:
    return sorted({s.ref for s in recipe.sources() if s.kind == "corpus"})


def check_sources(
    recipe: Recipe, settings: Settings, storage: Storage
) -> dict[str, dict[str, Any]]:
    """Allow-list, resolve and compare every source; returns ``{uri: source dict}``,
    each pinned to the files it holds now (what the worker will fetch, and nothing else).

    Blocking (file and S3 I/O): the API calls it in a worker thread.
    """
    if len(model_sources(recipe)) > settings.max_models_per_job:
        raise RecipeError(
            f"the job names {len(model_sources(recipe))} checkpoints; this service takes "
            f"at most {settings.max_models_per_job} (MAEC_MAX_MODELS_PER_JOB)",
            limit=settings.max_models_per_job,
        )
    parsed: dict[str, Source] = {}
    for uri in [*model_sources(recipe), *corpus_sources(recipe)]:
        parsed[uri] = parse_source(uri, settings)
    # Tokenizer files are read only for a recipe that merges vocabularies.
    tokenizer = recipe.vocab_source is not None
    folders: dict[str, ModelFolder] = {
        uri: inspect_source(parsed[uri], storage, tokenizer) for uri in model_sources(recipe)
    }
    plan_recipe(recipe, folders)
    # Pinned after the checks: a file replaced in between is pinned as replaced, which
    # lets nothing unchecked through (the engine validates the folder it reads).
    pinned = {uri: pin_source(parsed[uri], storage) for uri in model_sources(recipe)}
    for uri in corpus_sources(recipe):
        pinned[uri] = check_corpus(parsed[uri], storage, settings.max_corpus_bytes)
    return {uri: s.to_dict() for uri, s in pinned.items()}
