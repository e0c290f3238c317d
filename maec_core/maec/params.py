"""MAEC's parameters, their defaults, and recipe validation (torch-free).

Every choice the method document leaves open is a named parameter with a default here;
``MaecParams.model_dump()`` is what the job records, so a merge can always be redone.
The API imports this module before anything is queued, so it must not import torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from maec_core.errors import CorpusError, EmptySelection, RecipeError
from maec_core.methods.base import Finite
from maec_core.recipe.inputs import MethodInputs, SourceRef
from maec_core.recipe.values import Condition

if TYPE_CHECKING:
    import regex

    from maec_core.recipe import Recipe

# The default selection of included tensors: 2-D weights inside the transformer blocks
# (attention q/k/v/o and MLP gate/up/down); embeddings, lm_head, norms, biases excluded.
DEFAULT_INCLUDE = r"\.layers\."
# Parameters that shape the artifact (and so its content-addressed key). Selection and
# μ only matter at combination time, so changing them reuses the same artifact.
EXTRACTION_FIELDS = (
    "importance",
    "granularity",
    "key_ratio",
    "rank_scope",
    "include",
    "exclude",
    "artifact_dtype",
)
GRADIENT_FIELDS = ("token_budget", "batch_size", "seq_len")
# Patterns are user input run against every tensor name, so they are bounded: a length
# cap, a count cap, and the ``regex`` engine with a per-search time limit (a tensor name is
# under 200 characters; a search that takes longer than this is a pathological pattern).
PATTERN_MAX_CHARS = 512
PATTERNS_MAX = 32
SEARCH_TIMEOUT_S = 0.05
Pattern = Annotated[str, Field(max_length=PATTERN_MAX_CHARS)]
Patterns = Pattern | Annotated[list[Pattern], Field(max_length=PATTERNS_MAX)]


class AbilityEntry(BaseModel):
    """One ability for MAEC: the donor θA, optional control θS, weight μ, optional corpus."""

    model_config = ConfigDict(extra="forbid")

    model: str
    control: str | None = None
    mu: float = 1.0
    corpus: str | None = None
    name: str | None = None


class MaecInputs(MethodInputs):
    """MAEC's own top-level recipe keys: the target-language model θL, the abilities,
    and a stored ability vector to combine instead of extracting (``artifact``, local
    runs only)."""

    language_base: str | None = None
    abilities: list[AbilityEntry] = Field(default_factory=list)
    artifact: str | None = None

    def sources(self) -> list[SourceRef]:
        out = [] if self.language_base is None else [SourceRef("language_base",
                                                               self.language_base)]
        for i, a in enumerate(self.abilities):
            out.append(SourceRef("ability_donor", a.model, i))
            if a.control is not None:
                out.append(SourceRef("ability_control", a.control, i))
            if a.corpus is not None:
                out.append(SourceRef("ability_corpus", a.corpus, i, corpus=True))
        return out

    def with_sources(self, mapping: Mapping[str, str]) -> Self:
        def sub(ref: str | None) -> str | None:
            return mapping.get(ref, ref) if ref is not None else None

        return self.model_copy(update={
            "language_base": sub(self.language_base),
            "abilities": [a.model_copy(update={"model": mapping.get(a.model, a.model),
                                               "control": sub(a.control),
                                               "corpus": sub(a.corpus)})
                          for a in self.abilities]})

    def builds_on(self) -> str | None:
        return self.language_base


def maec_inputs(recipe: Recipe) -> MaecInputs:
    """The MAEC keys of ``recipe`` (empty ones for a recipe of another method)."""
    inputs = recipe.method_inputs
    return inputs if isinstance(inputs, MaecInputs) else MaecInputs()


def language_base_of(recipe: Recipe) -> str:
    """The language base θL of a checked MAEC recipe."""
    lang = maec_inputs(recipe).language_base
    assert lang is not None, "a checked MAEC recipe names its language base"
    return lang


class MaecParams(BaseModel):
    """``parameters:`` of a ``merge_method: maec`` recipe."""

    model_config = ConfigDict(extra="forbid")

    importance: Literal["delta", "gradient"] = "delta"
    granularity: Literal["row", "element"] = "row"
    key_ratio: Finite = Field(0.05, gt=0.0, le=1.0)
    rank_scope: Literal["tensor", "global"] = "tensor"
    # Regular expressions searched in tensor names. ``include: null`` means the default
    # rule (2-D tensors whose name contains ``.layers.``); an explicit include selects
    # any float tensor it matches. A string or a list of strings (a recipe's parameter
    # values carry one string: join alternatives with ``|``).
    include: Patterns | None = None
    exclude: Patterns | None = None
    selection: Literal["ratio", "threshold"] = "ratio"
    selection_ratio: Finite = Field(0.75, gt=0.0, le=1.0)
    selection_threshold: Finite | None = Field(None, ge=0.0)
    # null: the checkpoints' dtype (artifact ≈ key_ratio × model size); float32 is exact.
    artifact_dtype: Literal["float32", "float16", "bfloat16"] | None = None
    # importance: gradient only. Tokens of the ability corpus used (a fixed budget, in
    # file order), sequences per batch, tokens per sequence.
    token_budget: int = Field(131072, ge=2)
    batch_size: int = Field(8, ge=1)
    seq_len: int = Field(512, ge=2)

    @model_validator(mode="after")
    def _check(self) -> MaecParams:
        if self.selection == "threshold" and self.selection_threshold is None:
            raise ValueError("selection: threshold needs selection_threshold (a |cos| in [0, 1])")
        for fld in ("include", "exclude"):
            for pattern in _as_list(getattr(self, fld)):
                _compile(fld, pattern)
        return self

    def include_patterns(self) -> list[str]:
        return _as_list(self.include)

    def exclude_patterns(self) -> list[str]:
        return _as_list(self.exclude)

    def is_included(self, name: str, ndim: int) -> bool:
        """Whether tensor ``name`` (of ``ndim`` dimensions) takes part in extraction."""
        if self.include is None:
            chosen = ndim == 2 and _search("include", DEFAULT_INCLUDE, name)
        else:
            chosen = any(_search("include", p, name) for p in self.include_patterns())
        return chosen and not any(_search("exclude", p, name) for p in self.exclude_patterns())

    def check_selection(self, tensors: Iterable[tuple[str, int]]) -> None:
        """Refuse (EmptySelection) an include pattern that matches none of ``tensors``
        (``(name, ndim)`` pairs) or a selection that keeps none of them: the extraction
        would have nothing to do, so this is checked before any weight is read."""
        tensors = list(tensors)
        for pattern in self.include_patterns():
            if not any(_search("include", pattern, name) for name, _ in tensors):
                raise EmptySelection(
                    f"include pattern {pattern!r} matches no tensor of the checkpoints",
                    parameter="include", pattern=pattern,
                )
        if not any(self.is_included(name, ndim) for name, ndim in tensors):
            raise EmptySelection(
                "include/exclude select no tensor of the checkpoints: nothing to extract",
                include=self.include_patterns(), exclude=self.exclude_patterns(),
            )

    def extraction_dict(self, checkpoint_dtype: str) -> dict[str, Any]:
        """The parameters that determine the artifact, canonical (defaults resolved)."""
        out: dict[str, Any] = {k: getattr(self, k) for k in EXTRACTION_FIELDS}
        out["include"] = self.include_patterns() if self.include is not None else None
        out["exclude"] = self.exclude_patterns()
        out["artifact_dtype"] = self.artifact_dtype or checkpoint_dtype
        if self.importance == "gradient":
            out.update({k: getattr(self, k) for k in GRADIENT_FIELDS})
        return out


def _compile(fld: str, pattern: str) -> regex.Pattern[str]:
    # Imported on the first pattern: every process that finds the methods imports this
    # module (``maec merge`` of any method), few of them check a MAEC recipe's patterns.
    import regex

    try:
        return regex.compile(pattern)
    except regex.error as exc:
        raise ValueError(f"{fld} pattern {pattern!r} is not a regex: {exc}") from None
    except RecursionError:
        raise ValueError(f"{fld} pattern {pattern!r} nests too deeply") from None


def _search(fld: str, pattern: str, name: str) -> bool:
    """``pattern`` found in ``name``, within the time limit (RecipeError past it)."""
    try:
        return _compile(fld, pattern).search(name, timeout=SEARCH_TIMEOUT_S) is not None
    except ValueError as exc:
        raise RecipeError(str(exc), parameter=fld, pattern=pattern) from None
    except TimeoutError:
        raise RecipeError(
            f"{fld} pattern {pattern!r} took longer than {SEARCH_TIMEOUT_S} s on tensor "
            f"name {name!r}; simplify it", parameter=fld, pattern=pattern,
        ) from None


class AbilityParams(BaseModel):
    """Per-ability parameters: the named form gives one value for every donor, or a
    list with one value per donor (``abilities[i].mu`` in a recipe)."""

    model_config = ConfigDict(extra="forbid")

    mu: Finite = 1.0


def _as_list(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def ceil_count(ratio: float, n: int) -> int:
    """``ceil(ratio * n)`` on the decimal the user wrote, not on its binary float.

    ``0.07 * 100`` is ``7.000000000000001`` in binary floating point, so a naive ceil
    keeps 8 of 100; reading the ratio through its shortest repr (``Fraction('0.07')``)
    gives the 7 the user meant.
    """
    return math.ceil(Fraction(repr(float(ratio))) * n)


def key_count(key_ratio: float, n: int) -> int:
    """The method's rule: keep ``max(1, ceil(key_ratio * n))`` of ``n`` candidates."""
    return max(1, ceil_count(key_ratio, n)) if n > 0 else 0


def maec_params(recipe: Recipe) -> MaecParams:
    """Parse ``recipe.parameters`` as MAEC parameters (RecipeError naming each problem)."""
    raw: dict[str, Any] = {}
    for key, value in recipe.parameters.items():
        if isinstance(value, list) and any(isinstance(v, Condition) for v in value):
            raise RecipeError(
                f"MAEC parameter '{key}' takes one value for the whole model, "
                "not per-tensor conditions",
                parameter=key,
            )
        if isinstance(value, list) and key not in ("include", "exclude"):
            raise RecipeError(
                f"MAEC parameter '{key}' takes one value, not a list (layer gradient)",
                parameter=key,
            )
        raw[key] = value
    try:
        return MaecParams.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                problems.append(f"unknown MAEC parameter '{where}'")
            elif where:
                problems.append(f"parameters.{where}: {err['msg']}")
            else:
                problems.append(f"parameters: {err['msg'].removeprefix('Value error, ')}")
        raise RecipeError("invalid MAEC parameters: " + "; ".join(problems),
                          problems=problems) from None


def validate_maec_recipe(recipe: Recipe) -> MaecParams:
    """Check a ``merge_method: maec`` recipe without touching any file."""
    own = maec_inputs(recipe)
    if not recipe.base_model:
        raise RecipeError("MAEC needs base_model (θ0, the common pretrained ancestor)")
    if not own.language_base:
        raise RecipeError("MAEC needs language_base (θL, the target-language model)")
    if recipe.models:
        raise RecipeError(
            "MAEC takes abilities (each with model, optional control, mu, corpus), "
            "not models"
        )
    if not own.abilities:
        raise RecipeError("MAEC needs at least one entry in abilities (an ability donor θA)")
    params = maec_params(recipe)
    names: set[str] = set()
    for i, ab in enumerate(own.abilities):
        if not math.isfinite(ab.mu):
            raise RecipeError(f"abilities[{i}].mu must be a finite number", ability=i)
        name = ab.name or f"ability{i}"
        if name in names:
            raise RecipeError(f"abilities[{i}]: name {name!r} is used twice", ability=i)
        names.add(name)
        if params.importance == "gradient" and not ab.corpus:
            raise CorpusError(
                f"importance: gradient needs an ability corpus: abilities[{i}] "
                f"({name}) has no corpus (JSONL with {{\"text\": ...}} or plain text)",
                ability=i,
            )
    if own.artifact is not None and len(own.abilities) != 1:
        raise RecipeError("artifact names one ability vector; the recipe has "
                          f"{len(own.abilities)} abilities")
    return params
