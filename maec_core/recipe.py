"""Recipes: mergekit's YAML shape for the shared methods, plus MAEC's own fields.

Torch-free: the API validates job bodies with these models before anything is queued.
Unknown keys are errors that name the key (a typo must not silently change a merge).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from maec_core.errors import EvalSetError, MaecError, RecipeError, SweepError
from maec_core.eval.sets import MAX_SETS, EvalSetSpec
from maec_core.sweep.spec import SweepSpec

Scalar = float | int | bool | str
# A parameter value is a scalar, a gradient (list of numbers interpolated across layers,
# as in mergekit), or a list of {filter, value} conditions tried in order: the first
# whose filter is a substring of the tensor name wins; an entry without filter is the
# fallback. This is mergekit's syntax, so its recipes run unchanged.


class Condition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    filter: str | None = None
    value: Scalar | list[float]


# list[str] carries regex lists (MAEC's include/exclude); methods reject it by type.
ParamValue = Scalar | list[float] | list[Condition] | list[str]
DType = Literal["float32", "float16", "bfloat16"]


class ModelEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    parameters: dict[str, ParamValue] = Field(default_factory=dict)


class AbilityEntry(BaseModel):
    """One ability for MAEC: the donor θA, optional control θS, weight μ, optional corpus."""

    model_config = ConfigDict(extra="forbid")

    model: str
    control: str | None = None
    mu: float = 1.0
    corpus: str | None = None
    name: str | None = None


SourceRole = Literal["base", "language_base", "model", "ability_donor", "ability_control",
                     "ability_corpus", "tokenizer"]


@dataclass(frozen=True)
class SourceRef:
    """One reference to a checkpoint or corpus in a recipe, and the place it sits.

    ``index`` is the entry's position in ``models`` or ``abilities`` (None for the
    top-level fields). ``kind``: a checkpoint to read, a corpus file, or the tokenizer
    (which names one of the recipe's checkpoints, never a separate input).
    """

    role: SourceRole
    ref: str
    index: int | None = None

    @property
    def kind(self) -> Literal["checkpoint", "corpus", "tokenizer"]:
        if self.role == "ability_corpus":
            return "corpus"
        return "tokenizer" if self.role == "tokenizer" else "checkpoint"


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid")

    merge_method: str
    base_model: str | None = None
    models: list[ModelEntry] = Field(default_factory=list)
    parameters: dict[str, ParamValue] = Field(default_factory=dict)
    dtype: DType | None = None
    # mergekit: "base" or a model path whose tokenizer files are copied.
    tokenizer_source: str | None = None
    out_shard_size: int | str = "5GB"
    name: str | None = None
    # MAEC only (merge_method: maec).
    language_base: str | None = None
    abilities: list[AbilityEntry] = Field(default_factory=list)
    artifact: str | None = None
    # Evaluation and sweeps: what the job does with the merged model (the merge itself
    # ignores them). Eval set paths are sources, like the checkpoints'.
    evaluate: list[EvalSetSpec] | None = Field(default=None, min_length=1,
                                                max_length=MAX_SETS)
    evaluate_inputs: bool | None = None
    sweep: SweepSpec | None = None

    @field_validator("merge_method")
    @classmethod
    def _lower(cls, v: str) -> str:
        return v.strip().lower()

    @model_validator(mode="after")
    def _evaluation(self) -> Recipe:
        sets = {s.name: s for s in self.evaluate or []}
        if len(sets) != len(self.evaluate or []):
            raise ValueError("evaluate: two eval sets have the same name")
        if self.evaluate_inputs and not sets:
            raise ValueError("evaluate_inputs needs evaluate (the eval sets)")
        if self.sweep is not None:
            for use, target in (("objective", self.sweep.objective),
                                ("constraint", self.sweep.constraint)):
                if target is None:
                    continue
                found = sets.get(target.set)
                if found is None:
                    raise ValueError(f"sweep.{use}.set {target.set!r} is not one of the "
                                     f"eval sets ({', '.join(sets) or 'evaluate is empty'})")
                if found.kind != target.metric:
                    raise ValueError(f"sweep.{use}: eval set {target.set!r} measures "
                                     f"{found.kind}, not {target.metric}")
        return self

    def merge_only(self) -> Recipe:
        """This recipe without evaluation and sweep: what one merge runs."""
        return self.model_copy(update={"evaluate": None, "evaluate_inputs": None,
                                       "sweep": None})

    def shard_size_bytes(self) -> int:
        return parse_size(self.out_shard_size)

    def sources(self) -> list[SourceRef]:
        """Every checkpoint and corpus reference, in recipe order (base first).

        The one place that knows where references sit in a recipe: the API resolves
        these, the worker fetches them and rewrites them with :meth:`with_sources`.
        ``tokenizer_source: base`` is a keyword, not a reference.
        """
        out: list[SourceRef] = []
        if self.base_model is not None:
            out.append(SourceRef("base", self.base_model))
        if self.language_base is not None:
            out.append(SourceRef("language_base", self.language_base))
        out += [SourceRef("model", m.model, i) for i, m in enumerate(self.models)]
        for i, a in enumerate(self.abilities):
            out.append(SourceRef("ability_donor", a.model, i))
            if a.control is not None:
                out.append(SourceRef("ability_control", a.control, i))
            if a.corpus is not None:
                out.append(SourceRef("ability_corpus", a.corpus, i))
        if self.tokenizer_source is not None and self.tokenizer_source != "base":
            out.append(SourceRef("tokenizer", self.tokenizer_source))
        return out

    def with_sources(self, mapping: Mapping[str, str]) -> Recipe:
        """A copy with every reference found in ``mapping`` replaced by its value."""

        def sub(ref: str | None) -> str | None:
            return mapping.get(ref, ref) if ref is not None else None

        tokenizer = self.tokenizer_source
        return self.model_copy(update={
            "base_model": sub(self.base_model),
            "language_base": sub(self.language_base),
            "tokenizer_source": tokenizer if tokenizer == "base" else sub(tokenizer),
            "models": [m.model_copy(update={"model": mapping.get(m.model, m.model)})
                       for m in self.models],
            "abilities": [
                a.model_copy(update={"model": mapping.get(a.model, a.model),
                                     "control": sub(a.control), "corpus": sub(a.corpus)})
                for a in self.abilities
            ],
        })

    def to_yaml(self) -> str:
        """The recipe as YAML with every field spelled out (for recipe.yaml outputs)."""
        data = self.model_dump(mode="json", exclude_none=True)
        return yaml.safe_dump(data, sort_keys=False)


_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9,
          "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(value: int | str) -> int:
    """Parse a shard size such as ``5GB``, ``500MB`` or ``1048576``."""
    if isinstance(value, int):
        size = value
    else:
        text = value.strip().upper().replace(" ", "")
        num = text.rstrip("KMGIB")
        unit = text[len(num):]
        if unit not in _UNITS or not num:
            raise RecipeError(f"out_shard_size {value!r} is not a size like '5GB'")
        try:
            size = int(float(num) * _UNITS[unit])
        except ValueError:
            raise RecipeError(f"out_shard_size {value!r} is not a size like '5GB'") from None
    if size < 1024:
        raise RecipeError(f"out_shard_size must be at least 1024 bytes, got {size}")
    return size


def _explain(exc: ValidationError) -> MaecError:
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            problems.append(f"unknown key '{where}'")
        else:
            problems.append(f"{where}: {err['msg']}")
    return _error_class(exc)("invalid recipe: " + "; ".join(problems), problems=problems)


def _error_class(exc: ValidationError) -> type[MaecError]:
    """A problem only in the sweep block is ``invalid_sweep``, only in the eval sets
    ``invalid_eval_set``, so a caller can tell them from the merge's own (the checks of
    ``Recipe._evaluation`` name the block first)."""
    tops = {str(e["loc"][0]) if e["loc"] else str(e["msg"]).removeprefix("Value error, ")
            .split(".")[0].split(":")[0] for e in exc.errors()}
    if tops == {"sweep"}:
        return SweepError
    return EvalSetError if tops == {"evaluate"} else RecipeError


def parse_recipe(source: Recipe | Mapping[str, Any] | str | Path) -> Recipe:
    """Load a recipe from a model, a mapping, a YAML file path, or YAML text."""
    if isinstance(source, Recipe):
        return source
    data: Any
    if isinstance(source, Mapping):
        data = dict(source)
    else:
        text: str
        if isinstance(source, Path) or ("\n" not in source and source.endswith((".yaml", ".yml"))):
            try:
                text = Path(source).read_text()
            except OSError as exc:
                raise RecipeError(f"cannot read recipe {source}: {exc.strerror}") from None
        else:
            text = str(source)
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise RecipeError(f"recipe is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise RecipeError("recipe must be a YAML mapping")
    if "slices" in data:
        raise RecipeError("'slices' (passthrough/frankenmerge recipes) are not supported",
                          key="slices")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise _explain(exc) from None
    from maec_core.methods.registry import validate_recipe

    validate_recipe(recipe)
    # Checked here, not only when the writer asks: the API validates with parse_recipe
    # before queueing, and a bad size must be a 422, not a failed job.
    recipe.shard_size_bytes()
    return recipe
