"""A job request, turned into a recipe and checked before anything is queued.

Two body forms (docs/api.md): named checkpoints (``method`` + donors + language base) or a
recipe. Both end as one ``maec_core`` Recipe whose model names are source strings; every
source is then allow-listed, resolved and its headers compared (no weights are read).
"""

from __future__ import annotations

from typing import Any

from app.settings import Settings
from app.sources import Source, check_corpus, inspect_source, parse_source
from app.storage.base import Storage
from maec_contract import JobRequest as JobRequest  # the body model, shared with the client
from maec_core.errors import RecipeError
from maec_core.io.folder import ModelFolder
from maec_core.methods.specs import get_spec
from maec_core.plan import build_plan
from maec_core.recipe import AbilityEntry, ModelEntry, Recipe, parse_recipe


def _per_model(value: Any, n: int, key: str) -> list[Any]:
    """A per-model parameter: one value for every model, or a list of exactly n."""
    if isinstance(value, list):
        if len(value) != n:
            raise RecipeError(
                f"parameters.{key} is a list of {len(value)} values; give one value or "
                f"one per model ({n}: the donors, then the language base)", parameter=key,
            )
        return value
    return [value] * n


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
    method = req.method.strip().lower()
    params = dict(req.parameters or {})
    common: dict[str, Any] = {"dtype": req.dtype, "name": req.name}
    if req.shard_size is not None:
        common["out_shard_size"] = req.shard_size
    if method == "maec":
        mu = _per_model(params.pop("mu", 1.0), len(req.ability_donor), "mu")
        abilities = [
            AbilityEntry(model=d, control=req.source_control, corpus=req.ability_corpus,
                         mu=float(m))
            for d, m in zip(req.ability_donor, mu, strict=True)
        ]
        data: dict[str, Any] = {
            "merge_method": "maec", "base_model": req.base,
            "language_base": req.language_base,
            "abilities": [a.model_dump(exclude_none=True) for a in abilities],
            "parameters": params, **common,
        }
        return parse_recipe(data)
    if req.source_control is not None or req.ability_corpus is not None:
        raise RecipeError("source_control and ability_corpus are MAEC inputs; "
                          f"method '{method}' does not use them")
    spec = get_spec(method)
    names = [*req.ability_donor, req.language_base]
    per_model_keys = set(spec.model_params.model_fields) - {"role"}
    model_params: list[dict[str, Any]] = [{} for _ in names]
    for key in sorted(per_model_keys & set(params)):
        for i, v in enumerate(_per_model(params.pop(key), len(names), key)):
            model_params[i][key] = v
    if method == "layer_swap":
        if len(req.ability_donor) != 1:
            raise RecipeError("layer_swap takes exactly one ability donor")
        model_params[0]["role"] = "ability"
        model_params[1]["role"] = "language"
    models = [ModelEntry(model=n, parameters=p) for n, p in zip(names, model_params,
                                                                 strict=True)]
    data = {
        "merge_method": method, "base_model": req.base,
        "models": [m.model_dump() for m in models], "parameters": params, **common,
    }
    return parse_recipe(data)


def model_sources(recipe: Recipe) -> list[str]:
    """Every checkpoint the recipe reads, reference (base) first, no repeats."""
    out: list[str] = []
    for name in (
        recipe.base_model, recipe.language_base,
        *(m.model for m in recipe.models),
        *(a.model for a in recipe.abilities), *(a.control for a in recipe.abilities),
    ):
        if name is not None and name not in out:
            out.append(name)
    if recipe.tokenizer_source not in (None, "base") and recipe.tokenizer_source not in out:
        raise RecipeError("tokenizer_source must be 'base' or one of the recipe's models",
                          key="tokenizer_source")
    return out


def corpus_sources(recipe: Recipe) -> list[str]:
    return sorted({a.corpus for a in recipe.abilities if a.corpus is not None})


def check_sources(
    recipe: Recipe, settings: Settings, storage: Storage
) -> dict[str, dict[str, Any]]:
    """Allow-list, resolve and compare every source; returns ``{uri: source dict}``.

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
    folders: dict[str, ModelFolder] = {
        uri: inspect_source(parsed[uri], storage) for uri in model_sources(recipe)
    }
    build_plan(folders, next(iter(folders)))
    for uri in corpus_sources(recipe):
        check_corpus(parsed[uri], storage, settings.max_corpus_bytes)
    return {uri: s.to_dict() for uri, s in parsed.items()}
