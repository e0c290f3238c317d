"""A job request, turned into a recipe and checked before anything is queued.

Two body forms (docs/api.md): named checkpoints (``method`` + donors + language base) or a
recipe. Both end as one ``maec_core`` Recipe whose model names are source strings; every
source is then allow-listed, resolved and its headers compared (no weights are read).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.settings import Settings
from app.sources import Source, check_corpus, inspect_source, parse_source
from app.storage.base import Storage
from maec_core.errors import RecipeError
from maec_core.io.folder import ModelFolder
from maec_core.methods import NamedForm, get_method
from maec_core.plan import build_plan
from maec_core.recipe import Recipe, parse_recipe

_NAMED = ("method", "base", "ability_donor", "language_base", "source_control",
          "ability_corpus", "parameters", "dtype", "shard_size")


class JobRequest(BaseModel):
    """Body of POST /v1/jobs: exactly one of the named form (``method``) or ``recipe``."""

    model_config = ConfigDict(extra="forbid")

    method: str | None = Field(default=None, max_length=64)
    base: str | None = None
    ability_donor: list[str] | None = Field(default=None, min_length=1, max_length=16)
    language_base: str | None = None
    source_control: str | None = None
    ability_corpus: str | None = None
    parameters: dict[str, Any] | None = None
    dtype: Literal["float32", "float16", "bfloat16"] | None = None
    shard_size: str | int | None = None
    recipe: dict[str, Any] | None = None
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=200)
    name: str | None = Field(default=None, max_length=200)

    @field_validator("ability_donor", mode="before")
    @classmethod
    def _one_donor(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _one_form(self) -> JobRequest:
        named = [f for f in _NAMED if getattr(self, f) is not None]
        if self.recipe is not None:
            if named:
                raise ValueError(f"give either recipe or the named form, not both ({named})")
            return self
        if self.method is None:
            raise ValueError("give either recipe or method (with ability_donor and "
                             "language_base)")
        missing = [f for f in ("ability_donor", "language_base") if getattr(self, f) is None]
        if missing:
            raise ValueError(f"the named form needs {', '.join(missing)}")
        return self


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
        raise RecipeError("tokenizer_source must be 'base' or one of the recipe's models",
                          key="tokenizer_source")
    return out


def corpus_sources(recipe: Recipe) -> list[str]:
    return sorted({s.ref for s in recipe.sources() if s.kind == "corpus"})


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
