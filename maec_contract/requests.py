"""The body of ``POST /v1/jobs``: a union discriminated by ``kind`` (docs/api.md).

:data:`AnyJobRequest` is what the service accepts: a merge (``kind: merge``, the default:
a body without ``kind`` is a merge, :class:`JobRequest`: named checkpoints or a recipe,
checked by one validator) or an MoE build (``kind: moe``, :class:`MoeJobRequest`: a
mergekit-moe config). ``NamedJob`` and ``RecipeJob`` are the merge model narrowed to
one form, for callers that build a body. Strict (``extra="forbid"``): a misspelt key
fails here, not as a silent default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    field_validator,
    model_validator,
)


class JobSubmission(BaseModel):
    """What every kind of job's body may say besides what the job makes."""

    model_config = ConfigDict(extra="forbid")
    # Whether a client's installed recipe check reads this kind's recipe (a merge
    # recipe); other kinds are checked by the service only.
    checked_locally: ClassVar[bool] = False

    idempotency_key: str | None = Field(default=None, min_length=1, max_length=200)
    name: str | None = Field(default=None, max_length=200)
    # Where the service POSTs the finished job, signed (docs/api.md, Webhooks); the
    # service checks it against its allow-list at submission.
    callback_url: str | None = Field(default=None, min_length=1, max_length=2048)
    # Keep the job and its outputs past the retention period (until unpinned or deleted).
    pinned: bool | None = None
    # Which of the queued jobs a free worker takes first (docs/scheduling.md): every
    # high job before any normal one, every normal before any low; fair share between
    # keys within each. Capped per key by the service (403 priority_not_allowed).
    priority: Literal["low", "normal", "high"] | None = None

    def body(self) -> dict[str, Any]:
        """The JSON body to send; unset fields are left out so the service's defaults
        apply (e.g. shard_size "5GB")."""
        return self.model_dump(mode="json", exclude_none=True)


class NamedFields(BaseModel):
    """The named form's fields, declared here only: a merge body takes them
    (:class:`JobRequest`), a recipe body leaves them out (:data:`NAMED_FIELDS`), the
    service's schema drops them from its recipe form, and the merge methods read them
    (``maec_core.methods.NamedForm`` narrows this model)."""

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

    @field_validator("ability_donor", mode="before")
    @classmethod
    def _one_donor(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v


NAMED_FIELDS: tuple[str, ...] = tuple(NamedFields.model_fields)


# NamedFields first: the body's fields keep their order (the submission's, the named
# form's, then the merge's own).
class JobRequest(NamedFields, JobSubmission):
    """A merge job's body: exactly one of the named form (``method``) or ``recipe``."""

    checked_locally: ClassVar[bool] = True

    recipe: dict[str, Any] | None = None
    # The job's kind: a merge (also when left out).
    kind: Literal["merge"] | None = None
    # Either form: eval sets scored after the merge (each {name, language, kind, path:
    # a source, ...eval settings}), whether the inputs are scored too, and a parameter
    # sweep ({grid, objective, constraint, tie_break, publish}). In the recipe form they may also be
    # top-level keys of the recipe (not both).
    evaluate: list[dict[str, Any]] | None = Field(default=None, min_length=1,
                                                   max_length=64)
    evaluate_inputs: bool | None = None
    sweep: dict[str, Any] | None = None
    # Either form: what is published besides the merged checkpoint, as a recipe's
    # ``output`` ({gguf: TYPE} adds a GGUF file; docs/gguf.md). In the recipe form it may
    # also be the recipe's own key (not both).
    output: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_form(self) -> JobRequest:
        named = [f for f in NAMED_FIELDS if getattr(self, f) is not None]
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


class NamedJob(JobRequest):
    """Form 1: named checkpoints (``method``, ``ability_donor``, ``language_base``, ...);
    the service turns it into a recipe."""

    method: str = Field(max_length=64)
    recipe: None = None


class RecipeJob(JobRequest):
    """Form 2: a recipe (mergekit or MAEC shape), sent as ``{"recipe": ...}``."""

    recipe: dict[str, Any]


class KindRequest(JobSubmission):
    """The body of a kind other than a merge: its ``kind`` and its ``recipe``, which the
    service checks as that kind reads it."""

    KIND: ClassVar[str]
    # What the API's schema says of ``recipe``.
    RECIPE_DOC: ClassVar[str]
    recipe: dict[str, Any]


class MoeJobRequest(KindRequest):
    """An MoE build's body: ``recipe`` is a mergekit-moe config that builds a mixture of
    experts from dense checkpoints (docs/moe.md)."""

    KIND: ClassVar[str] = "moe"
    RECIPE_DOC: ClassVar[str] = "a mergekit-moe config (docs/moe.md)"
    kind: Literal["moe"]

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> MoeJobRequest:
        """The body that builds ``config`` (a mergekit-moe config)."""
        return cls(kind="moe", recipe=dict(config))


def request_kind(value: Any) -> str:
    """The kind a body (a mapping, or a request model) asks for: ``merge`` unless it
    says otherwise."""
    kind = value.get("kind") if isinstance(value, Mapping) else getattr(value, "kind", None)
    return kind if isinstance(kind, str) and kind else "merge"


# The body models of the kinds other than a merge: a new kind's model is one entry here
# (the union below and the API's body schema are made from it).
OTHER_KINDS: tuple[type[KindRequest], ...] = (MoeJobRequest,)
# Every kind's body model, by its ``kind``.
if TYPE_CHECKING:
    AnyJobRequest = JobSubmission
else:
    AnyJobRequest = Annotated[
        # Union[...]: the members are a tuple only known when the module runs.
        Union[Annotated[JobRequest, Tag("merge")],
              *(Annotated[m, Tag(m.KIND)] for m in OTHER_KINDS)],
        Discriminator(request_kind)]
_ANY: TypeAdapter[JobSubmission] = TypeAdapter(AnyJobRequest)


def parse_job_request(data: Any) -> JobSubmission:
    """``data`` validated as the body of its kind (ValidationError when it is none): a
    :class:`JobRequest` or one of :data:`OTHER_KINDS`."""
    return _ANY.validate_python(data)
