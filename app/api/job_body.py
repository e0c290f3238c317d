"""The typed body of ``POST /v1/jobs``, built from the merge methods' parameter models.

The shared contract (``maec_contract.JobRequest``) keeps ``parameters`` and ``recipe``
free-form so the client stays small; the API validates against this stricter copy, which
is also what its OpenAPI document shows:

* the named form is a union discriminated by ``method``, the recipe form a union
  discriminated by ``recipe.merge_method``, one member per registered method, each with
  that method's parameters (``params``, and ``model_params`` per model) as typed fields;
* strict types (no string or boolean where a number belongs), finite bounded numbers,
  and a length cap on every string and list.

Everything is generated from ``maec_core.methods.all_methods()`` and the recipe and
contract models, so a new method, parameter or recipe field appears here by itself. The
rules a schema cannot say (model counts, one value per model, a threshold that needs a
value) stay with the methods' own validation, run after this.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
from pydantic import (
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Strict,
    Tag,
    create_model,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError, PydanticUndefined

from app.api.bounds import BodyProblem, check_body
from maec_contract import (
    NAMED_FIELDS,
    OTHER_KINDS,
    JobRequest,
    JobSubmission,
    KindRequest,
    parse_job_request,
    request_kind,
)
from maec_core.service import (
    FINITE_MAX,
    MergeMethod,
    ModelEntry,
    Recipe,
    Slice,
    SliceSource,
    TensorMethod,
    all_methods,
)

# Caps for what the methods' models leave open. Strings: sources are paths, URIs or hub
# ids (S3 keys stop at 1024 bytes); lists: gradients, conditions, models; dicts: free
# parameter maps. Integers stay exact in any JSON reader (doubles) up to 2**53.
STR_MAX = 2048
FILTER_MAX = 256
LIST_MAX = 256
DICT_MAX = 64
INT_MAX = 2**53

_STRICT = ConfigDict(extra="forbid", strict=True)
# The typing forms, typed Any: the types here are built at run time, which mypy cannot
# follow (it checks the code that builds them, pydantic checks what they accept).
_A: Any = Annotated
_U: Any = Union
_L: Any = list
_D: Any = dict
_T: Any = tuple
_Lit: Any = Literal
# Tags of the unions built here ("recipe-form", "named-form" and these): never field
# names (they hold a hyphen), and left out of the locations error messages print.
VALUE_TAGS = ("as-value", "as-gradient", "as-conditions", "for-all-models", "per-model")
_NUMERIC = (at.Ge, at.Gt, at.Le, at.Lt, at.MultipleOf)
_LENGTH = (at.MinLen, at.MaxLen)


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def _flatten(meta: Sequence[Any]) -> list[Any]:
    """Constraint objects, with FieldInfo entries (``Annotated[x, Field(...)]``) opened."""
    out: list[Any] = []
    for m in meta:
        out += _flatten(m.metadata) if isinstance(m, FieldInfo) else [m]
    return out


def _number(tp: type, meta: Sequence[Any], bound: float) -> Any:
    # Callables (AfterValidator of the methods' Finite alias) are kept: they check more.
    keep = [m for m in meta if isinstance(m, _NUMERIC) or callable(getattr(m, "func", None))]
    if not any(isinstance(m, at.Ge | at.Gt) for m in keep):
        keep.append(at.Ge(-bound))
    if not any(isinstance(m, at.Le | at.Lt) for m in keep):
        keep.append(at.Le(bound))
    if tp is float:
        keep.insert(0, AllowInfNan(False))
    return _A[tp, *keep]


def _sized(tp: Any, meta: Sequence[Any], cap: int) -> Any:
    keep = [m for m in meta if isinstance(m, _LENGTH)]
    if not any(isinstance(m, at.MaxLen) for m in keep):
        keep.append(at.MaxLen(cap))
    return _A[tp, *keep]


def strict_type(tp: Any, meta: Sequence[Any] = ()) -> Any:
    """``tp`` (with its field constraints ``meta``) as a strict, bounded type."""
    origin = get_origin(tp)
    if origin is Annotated:
        base, *extra = get_args(tp)
        return strict_type(base, [*meta, *_flatten(extra)])
    if origin in (Union, types.UnionType):
        return _U[tuple(strict_type(a, meta) for a in get_args(tp))]
    if tp is type(None) or origin is Literal or tp is bool or tp is Any:
        return tp
    if tp is int:
        return _number(int, meta, INT_MAX)
    if tp is float:
        return _number(float, meta, FINITE_MAX)
    if tp is str:
        # A string keeps everything but number bounds (a pattern, a validator).
        rest = [m for m in meta if not isinstance(m, _NUMERIC + _LENGTH + (AllowInfNan,))]
        return _A[_sized(str, meta, STR_MAX), *rest] if rest else _sized(str, meta, STR_MAX)
    if origin is list:
        (item,) = get_args(tp)
        return _sized(_L[strict_type(item)], meta, LIST_MAX)
    if origin is tuple:
        args = get_args(tp)
        items = ([strict_type(args[0]), ...] if args[1:] == (...,)
                 else [strict_type(a) for a in args])
        # Strict mode takes only tuple instances; a JSON array arrives as a list (the
        # items stay strict).
        return _sized(_A[_T[tuple(items)], Strict(False)], meta, LIST_MAX)
    if origin is dict:
        key, value = get_args(tp)
        return _sized(_D[strict_type(key), strict_type(value)], meta, DICT_MAX)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return strict_model(tp)
    raise TypeError(f"no strict form for {tp!r}: teach app.api.job_body this type")


def _field(info: FieldInfo, annotation: Any, *, required: bool | None = None) -> Any:
    """``(annotation, FieldInfo)`` for create_model, keeping default, alias, description."""
    kw: dict[str, Any] = {"alias": info.alias, "description": info.description}
    if required:
        kw["default"] = PydanticUndefined
    elif info.default_factory is not None:
        kw["default_factory"] = info.default_factory
    else:
        kw["default"] = None if info.default is PydanticUndefined else info.default
    return (annotation, Field(**kw))


_MODELS: dict[tuple[type[BaseModel], str], type[BaseModel]] = {}


def strict_model(cls: type[BaseModel], name: str | None = None,
                 overrides: Mapping[str, Any] | None = None,
                 config: ConfigDict = _STRICT) -> type[BaseModel]:
    """A strict copy of ``cls`` (every field through :func:`strict_type`); ``overrides``
    replaces fields (name -> (annotation, FieldInfo)) or drops them (name -> None);
    ``config`` the model's config (strict, extra keys refused, unless told)."""
    name = name or cls.__name__
    key = (cls, name)
    if key not in _MODELS:
        fields: dict[str, Any] = {}
        for fname, info in cls.model_fields.items():
            fields[fname] = _field(info, strict_type(info.annotation, info.metadata),
                                   required=info.is_required())
        for fname, value in (overrides or {}).items():
            if value is None:
                fields.pop(fname, None)
            else:
                fields[fname] = value
        _MODELS[key] = create_model(name, __config__=config, __doc__=cls.__doc__,
                                    **fields)
    return _MODELS[key]


def _tagged(members: Mapping[str, Any], pick: Callable[[Any], str]) -> Any:
    return _A[_U[tuple(_A[t, Tag(k)] for k, t in members.items())], Discriminator(pick)]


def _is_float(scalar: Any) -> bool:
    return get_origin(scalar) is Annotated and get_args(scalar)[0] is float


def value_type(method: MergeMethod, prefix: str, fname: str, info: FieldInfo) -> Any:
    """What one parameter may be in a recipe. Tensor methods resolve it per tensor, so
    besides one value it may be a list of ``{filter, value}`` conditions and, for a float,
    a gradient over the layers (mergekit's syntax); MAEC takes one value."""
    scalar = strict_type(info.annotation, info.metadata)
    if not isinstance(method, TensorMethod):
        return scalar
    gradient = _is_float(scalar)
    points = _A[_L[scalar], at.MinLen(1), at.MaxLen(LIST_MAX)]
    entry = _U[scalar, points] if gradient else scalar
    condition = create_model(
        f"{prefix}{_camel(fname)}Condition", __config__=_STRICT,
        __doc__="Applies where ``filter`` is a substring of the tensor name (absent or "
                "'*': everywhere); the first matching condition wins.",
        filter=(_U[_A[str, at.MaxLen(FILTER_MAX)], None], None),
        value=(entry, ...),
    )
    members = {"as-value": scalar,
               "as-conditions": _A[_L[condition], at.MinLen(1), at.MaxLen(LIST_MAX)]}
    if gradient:
        members["as-gradient"] = points

    def pick(v: Any) -> str:
        if not isinstance(v, list):
            return "as-value"
        # Model instances too: the serializer asks again with the validated value.
        if gradient and not any(isinstance(x, dict | BaseModel) for x in v):
            return "as-gradient"
        return "as-conditions"

    return _tagged(members, pick)


def _per_model(value: Any) -> Any:
    # The named form: one value for every model, or a list with one value per model.
    return _tagged({"for-all-models": value,
                    "per-model": _A[_L[value], at.MinLen(1), at.MaxLen(64)]},
                   lambda v: "per-model" if isinstance(v, list) else "for-all-models")


def _params_fields(method: MergeMethod, prefix: str, model: type[BaseModel],
                   keys: set[str] | None = None, per_model: bool = False) -> dict[str, Any]:
    # Never required here: a value may come from another level (a slice, the recipe),
    # and the method's own check names a missing one.
    out: dict[str, Any] = {}
    for fname, info in model.model_fields.items():
        if keys is not None and fname not in keys:
            continue
        v = value_type(method, prefix, fname, info)
        out[fname] = _field(info, _per_model(v) if per_model else v, required=False)
    return out


# A recipe's top level takes keys no field reads: mergekit ignores them, so a recipe
# with a misspelled key runs there; ``maec_core.recipe`` drops them and the job record
# lists them as warnings.
_RECIPE = ConfigDict(extra="allow", strict=True)
# A parameter block also takes names the method does not read: mergekit accepts them
# (and ignores them), so a recipe written for it runs here; the recipe's own model
# checks their values' shape and the job record lists them as ignored.
_PARAMS = ConfigDict(extra="allow", strict=True)


def _params_model(name: str, doc: str, *fields: dict[str, Any]) -> type[BaseModel]:
    merged: dict[str, Any] = {}
    for f in fields:
        merged.update(f)
    return create_model(name, __config__=_PARAMS, __doc__=doc, **merged)


def _items(item: Any, lo: int = 0) -> Any:
    return _A[_L[item], at.MinLen(lo), at.MaxLen(LIST_MAX)]


def _method_models(method: MergeMethod) -> tuple[type[BaseModel], type[BaseModel]]:
    """The named-form job and the recipe for ``method``."""
    c = _camel(method.name)
    shared = _params_fields(method, c, method.params)
    own = _params_fields(method, c, method.model_params)
    # The recipe's and a slice's parameters may also give per-model values (mergekit's
    # lookup: the model's own, its slice's, the recipe's); a models recipe takes only
    # the method's own there, which the method's check says.
    params = _params_model(f"{c}Parameters", f"parameters of merge_method {method.name} "
                           "(per-model ones too, as defaults)", own, shared)
    model_params = _params_model(f"{c}ModelParameters",
                                 f"per-model parameters of merge_method {method.name}", own)
    named_params = _params_model(
        f"{c}NamedParameters",
        f"parameters of method {method.name} in the named form (per-model ones: one value "
        "for all, or one per model: the donors, then the language base)",
        shared, _params_fields(method, c, method.model_params, method.per_model_keys(), True))
    per_model = {"parameters": (model_params, Field(default_factory=model_params))}
    entry = strict_model(ModelEntry, f"{c}ModelEntry", per_model)
    source = strict_model(SliceSource, f"{c}SliceSource", per_model)
    piece = strict_model(Slice, f"{c}Slice", {
        "sources": (_items(source, 1), Field()),
        "parameters": (params, Field(default_factory=params)),
    })
    # The method's own top-level keys (its inputs model), beside the shared recipe's.
    inputs = method.inputs.model_fields if method.inputs is not None else {}
    recipe = strict_model(Recipe, f"{c}Recipe", {
        **{k: _field(info, strict_type(info.annotation, info.metadata),
                     required=info.is_required()) for k, info in inputs.items()},
        "merge_method": (_Lit[method.name], Field()),
        "models": (_items(entry), Field(default_factory=list)),
        "slices": (_U[_items(piece, 1), None], Field(default=None)),
        "parameters": (params, Field(default_factory=params)),
    }, _RECIPE)
    named = strict_model(JobRequest, f"{c}NamedJob", {
        "method": (_Lit[method.name], Field()),
        "ability_donor": (_U[strict_type(str), _sized(_L[strict_type(str)],
                                                       [at.MinLen(1), at.MaxLen(16)], 16)],
                          Field(description="one source, or a list of them")),
        "language_base": (strict_type(str), Field()),
        "parameters": (named_params | None, Field(default=None)),
        "recipe": None,
    })
    return named, recipe


def _normalize(value: Any) -> Any:
    """Method names are case-insensitive (as in a recipe): lower them before the unions
    pick a member; an unknown name is a recipe problem, not a schema one. First of all,
    the whole body's text and nesting are checked (:func:`app.api.bounds.check_body`):
    every field, the free-form ones included, before any member's validation."""
    try:
        check_body(value)
    except BodyProblem as exc:
        raise PydanticCustomError(exc.kind, "{problem}", {"problem": str(exc)}) from None
    if not isinstance(value, dict) or _form(value) in (None, *_KIND_FORMS.values()):
        return value  # the form's own error says what is wrong (an MoE config: no method)
    out = dict(value)
    holder, key = (out, "method")
    if isinstance(out.get("recipe"), dict):
        out["recipe"] = dict(out["recipe"])
        holder, key = out["recipe"], "merge_method"
    name = holder.get(key)
    if isinstance(name, str):
        holder[key] = name.strip().lower()
        if holder[key] not in KNOWN:
            raise PydanticCustomError(
                "unknown_method", "unknown merge_method '{name}'; known: {known}",
                {"name": name, "known": ", ".join(KNOWN)})
    return out


def _form(value: Any) -> str | None:
    if not isinstance(value, dict):
        return "named-form"  # refused there with the type error
    kind_form = _KIND_FORMS.get(request_kind(value))
    if kind_form is not None:
        return kind_form  # before the recipe form: its recipe is that kind's
    if "recipe" in value:
        # The contract's rule: a named-form field set beside a recipe is an error.
        both = any(value.get(f) is not None for f in NAMED_FIELDS)
        return None if both else "recipe-form"
    return "named-form" if "method" in value else None


# The body forms of the kinds other than a merge, by the ``kind`` that selects them.
_KIND_FORMS = {m.KIND: f"{m.KIND}-form" for m in OTHER_KINDS}


def _kind_job(model: type[KindRequest]) -> type[BaseModel]:
    """``{"kind": <kind>, "recipe": {...}}`` of a kind other than a merge: the recipe
    (an MoE build's mergekit-moe config) is checked by the kind's own module at
    submission (``app.kinds``), so here it is only a bounded object."""
    return strict_model(model, model.__name__.removesuffix("Request"), {
        "kind": (_Lit[model.KIND], Field()),
        "recipe": (_A[_D[_A[str, at.MaxLen(FILTER_MAX)], Any], at.MaxLen(DICT_MAX)],
                   Field(description=model.RECIPE_DOC)),
    })


def _build() -> Any:
    pairs = [_method_models(m) for m in all_methods()]
    named = _A[_U[tuple(n for n, _ in pairs)], Field(discriminator="method")]
    recipes = _A[_U[tuple(r for _, r in pairs)], Field(discriminator="merge_method")]
    recipe_job = strict_model(JobRequest, "RecipeJob", {
        **dict.fromkeys(NAMED_FIELDS),  # dropped: they belong to the named form
        "recipe": (recipes, Field(description="a recipe (mergekit or MAEC shape)")),
    })
    return _A[
        _U[_A[recipe_job, Tag("recipe-form")], _A[named, Tag("named-form")],
           *(_A[_kind_job(m), Tag(_KIND_FORMS[m.KIND])] for m in OTHER_KINDS)],
        Discriminator(_form, custom_error_type="invalid_form", custom_error_message=(
            "give exactly one of the two forms: recipe, or method (with ability_donor and "
            "language_base)")),
        BeforeValidator(_normalize),
    ]


KNOWN = [m.name for m in all_methods()]
if TYPE_CHECKING:
    JobBody = BaseModel
else:
    JobBody = _build()
    """The body model of POST /v1/jobs (use as a route parameter's type)."""


def to_request(body: BaseModel) -> JobSubmission:
    """The validated body as the contract's request of its kind (what the submission
    path takes)."""
    return parse_job_request(body.model_dump(by_alias=True, exclude_unset=True))


def describe_errors(errors: Sequence[Any]) -> tuple[str, list[str]]:
    """The code and one line per problem for a body's validation errors.

    A problem inside the method's parameters or the recipe (or an unknown method) is
    ``invalid_recipe``, as the methods' own checks would call it; anything else in the
    body (a missing source, a bad dtype) is ``invalid_request``.
    """
    recipe = bool(errors) and all(_recipe_problem(e) for e in errors)
    problems = []
    for err in errors:
        loc = _clean(err.get("loc", ()))
        where = ".".join(str(p) for p in loc)
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            leaf = str(loc[-1]) if loc else where
            parent = ".".join(str(p) for p in loc[:-1])
            msg = (f"unknown parameter '{leaf}' in {parent}" if "parameters" in loc[:-1][-1:]
                   else f"unknown key '{where}'")
            problems.append(msg)
        else:
            problems.append(f"{where}: {msg}" if where else msg)
    return ("invalid_recipe" if recipe else "invalid_request"), problems


def _clean(loc: Sequence[Any]) -> list[Any]:
    """A location without ``body`` and the unions' tags (form, method, value kind)."""
    out = list(loc[1:]) if loc[:1] == ("body",) or list(loc[:1]) == ["body"] else list(loc)
    if out[:1] == ["named-form"]:
        out = out[2:]  # the form tag, then the method tag
    elif out[:1] and out[0] in _KIND_FORMS.values():
        out = out[1:]
    elif out[:1] == ["recipe-form"]:
        out = out[1:]
        if out[:1] == ["recipe"] and len(out) > 1:
            out = ["recipe", *out[2:]]  # the merge_method tag
    # pydantic names the member of a plain union it tried ("constrained-str",
    # "list[constrained-int]"): not a place in the body.
    return [p for p in out if p not in VALUE_TAGS and not (
        isinstance(p, str) and (p.startswith(("constrained-", "function-")) or "[" in p))]


def _recipe_problem(err: Mapping[str, Any]) -> bool:
    if err.get("type") == "unknown_method":
        return True
    loc = list(err.get("loc", ()))
    if loc[:2] == ["body", "named-form"]:
        return loc[3:4] in (["parameters"], ["shard_size"])
    if loc[:3] == ["body", "recipe-form", "recipe"]:
        # Below the recipe, or a recipe object without a (known) merge_method; a recipe
        # that is not an object at all is a schema problem.
        return len(loc) > 3 or err.get("type") in ("union_tag_invalid", "union_tag_not_found")
    return False
