"""A merge method as one unit: parameters, validation, named-form mapping, tensor function.

Each method is a subclass of :class:`MergeMethod` (usually :class:`TensorMethod`) in its
own module under ``maec_core.methods``; defining the class registers it, and
``maec_core.methods.registry`` imports every module of the package, so adding a method
is adding a file. Torch-free at import: the API imports every method module to validate
recipes and map named bodies, so torch is imported only inside tensor functions (or
under ``TYPE_CHECKING``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Protocol

from pydantic import (
    AfterValidator,
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
)

from maec_contract import NAMED_FIELDS, NamedFields
from maec_core.errors import RecipeError
from maec_core.methods.params import candidate_values
from maec_core.recipe.inputs import MethodInputs, register_inputs
from maec_core.recipe.values import condition_warnings

if TYPE_CHECKING:
    from pathlib import Path

    import click
    import torch

    from maec_core.artifact_store import ArtifactStore
    from maec_core.context import RunContext
    from maec_core.io.folder import ModelFolder
    from maec_core.native import Flat
    from maec_core.recipe import Recipe
    from maec_core.runtime import MergeResult


# The largest magnitude a float parameter may have: every real recipe value is far
# inside it, and anything outside would overflow float16 outputs or only ever be a typo.
FINITE_MAX = 1e6


def _within_max(value: float) -> float:
    # A validator, not ge/le: a field's own ``Field(le=1.0)`` must not be widened back
    # to the alias's bound (pydantic lets the alias's constraints win over the field's).
    if abs(value) > FINITE_MAX:
        raise ValueError(f"must be within ±{FINITE_MAX:g}")
    return value


Finite = Annotated[float, AllowInfNan(False), AfterValidator(_within_max)]
"""A float parameter: no inf or NaN (JSON job records would store them as null), and
at most ``FINITE_MAX`` in magnitude.

Use it for every float field of a method's ``params``/``model_params``; a field's own
``Field(ge=..., le=...)`` narrows the range further (``x: Finite = Field(0.5, le=1.0)``).
"""


class Params(BaseModel):
    """Base of every parameter model: an unknown key is an error naming the key."""

    model_config = ConfigDict(extra="forbid")


class NoParams(Params):
    pass


@dataclass(frozen=True)
class TensorCall:
    """One tensor's merge inputs, all float32 on the compute device.

    ``models`` are the recipe's models besides ``base`` (in recipe order), with
    ``model_params`` resolved for this tensor; ``params`` are the method's global
    parameters resolved for this tensor.

    The input tensors belong to the call: the engine hands out private float32 copies,
    so a method may overwrite them and return one of them (the cheapest way to produce
    its result). For element-wise methods they may be flat slices of the real tensors.
    """

    name: str
    base: torch.Tensor | None
    models: Sequence[torch.Tensor]
    model_params: Sequence[Any]
    params: Any
    layer: int | None
    num_layers: int
    # What the method's first pass over the whole tensor found (``first_pass``), on the
    # streamed 16-bit path; None: the inputs are whole tensors.
    reduced: Any = None


# A compiled kernel over flat runs (:meth:`TensorMethod.kernel`): (inputs, out) -> whether
# every entry of ``out`` is finite, or None when it declines them.
Kernel = Callable[["Sequence[Flat]", "Flat"], "bool | None"]


class FirstPass(Protocol):
    """A per-tensor reduction run over flat slices before the element-wise pass."""

    def add(self, base: torch.Tensor | None, models: Sequence[torch.Tensor]) -> None:
        """Take the next flat slices (stored dtype, read-only), in order."""

    def finish(self) -> Any:
        """The call's ``reduced`` for the slices' merges; None: merge the tensor whole
        (unless :meth:`again`)."""

    def again(self) -> bool:
        """After :meth:`finish`: whether to take every slice once more (a reduction that
        needs the previous one's result)."""


class NamedForm(NamedFields):
    """The API's named body: checkpoints by role instead of a recipe. Its fields are the
    contract's (:class:`maec_contract.NamedFields`, declared there only), narrowed to
    what a method reads: the donors and the language base given.

    ``parameters`` holds the method's global parameters and, for per-model ones, one
    value for every model or a list with one value per model (donors, then the
    language base).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    ability_donor: list[str] = Field(min_length=1, max_length=16)
    language_base: str
    parameters: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def of(cls, body: NamedFields) -> NamedForm:
        """The named form a body (a merge request) gives, field for field."""
        return cls.model_validate(body.model_dump(include=set(NAMED_FIELDS),
                                                  exclude_none=True))


def per_model(value: Any, n: int, key: str) -> list[Any]:
    """A per-model parameter of the named form: one value for all n, or a list of n."""
    if isinstance(value, list):
        if len(value) != n:
            raise RecipeError(
                f"parameters.{key} is a list of {len(value)} values; give one value or "
                f"one per model ({n}: the donors, then the language base)", parameter=key,
            )
        return value
    return [value] * n


def check_params(model: type[BaseModel], values: Mapping[str, Any], where: str) -> None:
    """Validate every scalar each parameter may take (conditions and gradients included)."""
    lists = {k: candidate_values(v) for k, v in values.items()}
    width = max((len(v) for v in lists.values()), default=0)
    for i in range(max(width, 1)):
        sample = {k: v[min(i, len(v) - 1)] for k, v in lists.items() if v}
        try:
            model.model_validate(sample)
        except ValidationError as exc:
            problems = []
            for err in exc.errors():
                key = ".".join(str(p) for p in err["loc"])
                if err["type"] == "extra_forbidden":
                    problems.append(f"unknown parameter '{key}' in {where}")
                else:
                    problems.append(f"{where}.{key}: {err['msg']}")
            raise RecipeError("; ".join(problems), problems=problems) from None


def _only(values: Mapping[str, Any], keys: set[str]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if k in keys}


def field_keys(model: type[BaseModel]) -> set[str]:
    """The keys a parameter model accepts (aliases where set: ``lambda``)."""
    return {f.alias or name for name, f in model.model_fields.items()}


@dataclass(frozen=True)
class OwnVocab:
    """The output vocabulary's rows as a method decides them (None: the reference
    model's own, nothing remapped)."""

    rows: int | None


# What decides the work candidates of a sweep can share: (parameter, value) pairs, equal
# for candidates that share it.
ReuseKey = tuple[tuple[str, int | float], ...]


@dataclass(frozen=True)
class Made:
    """What one candidate's run made that the later candidates of its group reuse.

    ``files`` are worth holding in memory while the group runs (the sweep holds them when
    its budget allows); ``state`` is the method's own, handed back to
    :meth:`MergeMethod.run_reusing` untouched.
    """

    files: list[Path]
    state: Any


class PhasedMerge(Protocol):
    """How a merge of one recipe runs split into parts (contiguous groups of its output
    shards) when its method decides something over the whole model, which no part sees
    alone (MAEC: the tensors kept, from the c_t of all of them).

    The caller (the service's split merge) runs :meth:`before` once, then for each of
    :attr:`phases` every part's :meth:`run_part` and, once all are done, :meth:`decide`
    once; each gives a small text (a record, or a part's result) the caller keeps and
    hands back. Last, each part merges its shards (``EngineOptions.part``) with every
    record given (``EngineOptions.phase_records``), as does the final step that writes
    the index and the other files: the result is the unsplit merge's byte for byte.
    Every step is a function of the recipe, the inputs and the records: one redone
    (its worker lost) gives the same text.
    """

    # The phases before the one that makes the shards.
    phases: tuple[str, ...]

    def shard_count(self) -> int:
        """The output's planned shard count, from the inputs' headers."""

    def before(self, workdir: Path, ctx: RunContext) -> str:
        """What runs once before the parts (``workdir``: scratch space); records[0]."""

    def run_part(self, phase: int, part: tuple[int, int], records: Sequence[str],
                 ctx: RunContext) -> str:
        """Phase ``phase`` of the part making shards ``part[0]`` to ``part[1] - 1``,
        given the records so far; the part's result."""

    def decide(self, phase: int, results: Sequence[str], records: Sequence[str],
               ctx: RunContext) -> str:
        """From every part's result of phase ``phase`` (in part order): the record the
        next phase is given."""


_REGISTRY: dict[str, MergeMethod] = {}


class MergeMethod:
    """A merge method: what a recipe naming it may say, and how a named body maps to it.

    Subclasses set the class attributes; a subclass that defines ``name`` in its own
    body is registered (one instance) when the class is created.
    """

    name: ClassVar[str]
    paper: ClassVar[str]
    # Global parameters (``parameters:``) and per-model ones (``models[i].parameters``).
    params: ClassVar[type[BaseModel]] = NoParams
    model_params: ClassVar[type[BaseModel]] = NoParams
    needs_base: ClassVar[bool] = True
    # Whether a given base_model takes part in the merge (passthrough copies its one
    # source whatever base_model says, as mergekit's does).
    uses_base: ClassVar[bool] = True
    # Whether the method computes in float32 whatever the recipe's dtype says (MAEC:
    # its selection statistics are sums over whole tensors that 16 bits distort).
    float32_only: ClassVar[bool] = False
    # The dtype the merged tensors are saved in when the recipe gives no out_dtype, where
    # mergekit 0.1.5 saves them in one whatever the compute dtype (arcee_fusion and
    # ramplus_tl: their tensor functions return float32); None: the compute dtype.
    result_dtype: ClassVar[Literal["float32"] | None] = None
    # Models besides base_model the recipe must list (max None: no upper bound).
    min_models: ClassVar[int] = 1
    max_models: ClassVar[int | None] = None
    # The method's own top-level recipe keys (MAEC's ``language_base``, ``abilities``),
    # as a model of their own; None: the method reads none (the shared recipe has none).
    inputs: ClassVar[type[MethodInputs] | None] = None
    # The recipe key of the method's own list of entries (MAEC: ``abilities``) and the
    # keys of an entry a sweep may vary, in every entry (``mu``) or one
    # (``abilities[i].mu``): see entry_count and with_entry_value.
    entries: ClassVar[str | None] = None
    entry_knobs: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            return
        cls._check_complete()
        if cls.name in _REGISTRY:
            raise TypeError(f"merge method {cls.name!r} is defined twice "
                            f"({type(_REGISTRY[cls.name]).__module__} and {cls.__module__})")
        _REGISTRY[cls.name] = cls()
        if cls.inputs is not None:
            register_inputs(cls.name, cls.inputs)

    @classmethod
    def _check_complete(cls) -> None:
        """Refuse, when the class is defined, a method that could not run."""
        if not hasattr(cls, "paper"):
            raise TypeError(f"merge method {cls.name!r} does not name its paper")

    def validate(self, recipe: Recipe) -> None:
        """Check a recipe naming this method (RecipeError naming the problem).

        The default checks the recipe's shape (base, model count, no other method's own
        inputs) and every parameter's name and range; methods add their own rules on top.
        """
        for other in _REGISTRY.values():
            if other is not self:
                other.refuse_own_inputs(recipe, self.name)
        if self.needs_base and not recipe.base_model:
            raise RecipeError(f"merge_method '{self.name}' needs base_model")
        if recipe.layered:
            self._validate_slices(recipe)
            return
        self._check_count(self._models_counted(recipe))
        # Top-level parameters hold the method's own and, as in mergekit, defaults for
        # every model's; a key the method does not read is reported by ``ignored``.
        self._check_mixed(recipe.parameters, "parameters")
        # The method's own parameters come from this level only: a required one missing
        # is named now.
        check_params(self.params, _only(recipe.parameters, field_keys(self.params)),
                     "parameters")
        own = field_keys(self.model_params)
        for i, m in enumerate(recipe.models):
            check_params(self.model_params, _only(m.parameters, own),
                         f"models[{i}].parameters")

    def refuse_own_inputs(self, recipe: Recipe, method: str) -> None:
        """Refuse (RecipeError) a recipe for ``method`` that gives this method's own
        top-level inputs; the owner knows them, so shared code never names them. The
        default owns none."""

    def refuse_own_named_inputs(self, form: NamedForm, method: str) -> None:
        """Refuse (RecipeError) a named body for ``method`` that gives the named-form
        inputs only this method reads; the default reads none of its own."""

    def _models_counted(self, recipe: Recipe) -> int:
        """The models a models recipe merges besides its base (the base alone counts as
        one model for a method that merges it like any other)."""
        if not self.uses_base:
            return len(recipe.models)
        others = len([m for m in recipe.models if m.model != recipe.base_model])
        if others == 0 and not self.needs_base and recipe.base_model is not None:
            return 1
        return others

    def ignored(self, recipe: Recipe) -> list[str]:
        """Every parameter the recipe gives that this method does not read, named by
        where it sits: accepted (mergekit ignores them too, with the same result) and
        reported, so nothing a user wrote is dropped silently."""
        shared, own = field_keys(self.params), field_keys(self.model_params)
        everywhere = shared | own
        blocks = [(where, values, own if one_model else everywhere)
                  for where, values, one_model in recipe.parameter_blocks()]
        known = {k for m in _REGISTRY.values()
                 for k in field_keys(m.params) | field_keys(m.model_params)}
        out = []
        for where, values, keys in blocks:
            for key in sorted(set(values) - keys):
                why = (f"merge_method '{self.name}' does not read it" if key in known
                       else "no merge method knows this name")
                if key in shared and keys is own:
                    why = (f"'{key}' is a parameter of the whole merge for "
                           f"'{self.name}', not of one model")
                out.append(f"{where}.{key} ignored: {why}")
            for key in sorted(set(values) & keys):
                out += condition_warnings(f"{where}.{key}", values[key])
        return out

    def saved_dtype(self, recipe: Recipe, input_dtype: str) -> str:
        """The dtype the merged tensors are written in: the recipe's ``out_dtype``, else
        the method's :attr:`result_dtype`, else the compute dtype (``dtype``, else the
        inputs'). The output config.json says ``out_dtype or dtype`` whatever this is,
        as mergekit's does."""
        return recipe.out_dtype or self.result_dtype or recipe.dtype or input_dtype

    def separate_base(self, recipe: Recipe) -> bool:
        """Whether a models recipe's base is read apart from its models (as the call's
        ``base``): always for a method that uses a base; for one that does not (linear),
        only when the base is not listed among the models."""
        return self.uses_base or all(m.model != recipe.base_model for m in recipe.models)

    def merged_entries(self, recipe: Recipe) -> list[Any]:
        """The models entries the call's ``models`` hold, in order."""
        separate = self.separate_base(recipe)
        return [m for m in recipe.models if not separate or m.model != recipe.base_model]

    def resolve_models(self, recipe: Recipe, entries: Sequence[Any], name: str,
                       num_layers: int) -> tuple[list[Any], Any]:
        """(each of ``entries``' parameters, the method's) for tensor ``name`` of a
        models recipe: a model's own value, else the recipe's top-level one (mergekit's
        precedence), validated; keys the method does not read are left out."""
        from maec_core.methods.params import layer_fraction, resolve_scopes, validate_resolved

        frac = layer_fraction(name, num_layers)
        own, shared = field_keys(self.model_params), field_keys(self.params)
        models = [validate_resolved(self.model_params, resolve_scopes(
            [e.parameters, recipe.parameters], own, name, frac), name) for e in entries]
        params = validate_resolved(self.params, resolve_scopes(
            [recipe.parameters], shared, name, frac), name)
        return models, params

    def _validate_slices(self, recipe: Recipe) -> None:
        """Each slice (and each module given as models) as its own merge: the base among
        its sources when the method needs one, the model count, and parameters at every
        level. A slice's, a module's and the recipe's ``parameters`` may also give
        per-model values (mergekit's lookup order: the source, its slice, its module,
        the recipe)."""
        base = recipe.base_model if self.uses_base else None
        self._check_mixed(recipe.parameters, "parameters")
        for name, mod in (recipe.modules or {}).items():
            self._check_mixed(mod.parameters, f"modules.{name}.parameters")
        for i, laid in enumerate(recipe.laid_slices()):
            where = laid.where
            models = [m for m, _ in laid.sources]
            if self.needs_base and base not in models:
                raise RecipeError(f"merge_method '{self.name}' needs base_model {base!r} "
                                  f"among the sources of {where}", slice=i)
            self._check_count(len([m for m in models if m != base]), f" in {where}")
            self._check_mixed(laid.parameters, f"{where}.parameters")
            for j, (_, params) in enumerate(laid.sources):
                check_params(self.model_params,
                             _only(params, field_keys(self.model_params)),
                             f"{laid.source_where(j)}.parameters")

    def _check_mixed(self, values: Mapping[str, Any], where: str) -> None:
        """Validate a parameter block that may hold global and per-model keys (keys the
        method does not read are reported by ``ignored``, not checked)."""
        shared, own = field_keys(self.params), field_keys(self.model_params)
        for model, keys in ((self.params, shared), (self.model_params, own)):
            part = {k: v for k, v in values.items() if k in keys}
            # Only what is given: a required per-model key may come from another level.
            if part:
                check_params(model, part, where)

    def _check_count(self, n: int, where: str = "") -> None:
        lo, hi = self.min_models, self.max_models
        if lo <= n and (hi is None or n <= hi):
            return
        want = f"exactly {lo}" if hi == lo else f"at least {lo}"
        if hi is not None and hi != lo:
            want += f" and at most {hi}"
        besides = " besides base_model" if self.uses_base else ""
        raise RecipeError(
            f"merge_method '{self.name}' takes {want} model(s){besides}{where}, got {n}"
        )

    def check_plan(self, recipe: Recipe, tensors: Iterable[tuple[str, int]]) -> None:
        """Refuse, from the checkpoints' headers (the planned tensors' ``(name, ndim)``),
        a recipe that would fail once its weights are read; the default checks nothing
        (the submission checks tensor methods' filters and parameters itself)."""

    def own_vocab(self, recipe: Recipe, folders: Mapping[str, ModelFolder]) -> OwnVocab | None:
        """The output vocabulary when the method decides it from ``folders`` (the
        recipe's checkpoints by reference, header views); None (the default): the
        recipe's tokenizer settings decide it."""
        return None

    def run(self, recipe: Recipe, out: Path, ctx: RunContext) -> MergeResult:
        """Merge ``recipe`` into ``out`` by a method's own pipeline; a tensor method is
        run by the engine instead (``maec_core.engine.run_method``)."""
        raise NotImplementedError(f"merge method {self.name!r} has no pipeline of its own")

    # A sweep asks these, never the method's name: a method whose runs make something
    # (an extraction) that other parameter values can reuse says what decides it, gives
    # it back after the first run, and runs the rest from it.

    def reuse_key(self, recipe: Recipe) -> ReuseKey | None:
        """What decides the work a run of ``recipe`` can share with other candidates of a
        sweep (equal keys: one run's work serves all); None: it shares nothing."""
        return None

    def made(self, result: MergeResult, store: ArtifactStore) -> Made | None:
        """What a run (its ``result``) made for the rest of its reuse group, found in
        ``store``; None when nothing is there to reuse (the next candidate runs whole)."""
        return None

    def run_reusing(self, recipe: Recipe, made: Made, out: Path, ctx: RunContext
                    ) -> dict[str, Any]:
        """Merge ``recipe`` into ``out`` from what an earlier run of its group ``made``;
        the folder's manifest."""
        raise NotImplementedError(f"merge method {self.name!r} reuses nothing")

    def phased(self, recipe: Recipe) -> PhasedMerge | None:
        """How a merge of ``recipe`` runs split into parts when the method decides
        something over the whole model; None (the default): a tensor method's merge
        splits by shards alone, and a method with a pipeline of its own is not split."""
        return None

    def extracts(self) -> bool:
        """Whether a run makes something before it merges that a later run may merge
        from (a stage of its own, progress reported under ``extract``): derived from
        the reuse hooks, true for a method that runs from what another run made."""
        return type(self).run_reusing is not MergeMethod.run_reusing

    def check_service(self, recipe: Recipe) -> None:
        """Refuse (RecipeError) what ``recipe`` may say on a local run but not in a job
        of the service (nothing by default)."""

    def entry_count(self, recipe: Recipe) -> int:
        """How many of its own entries (:attr:`entries`) ``recipe`` gives."""
        return 0

    def with_entry_value(self, recipe: Recipe, key: str, index: int | None,
                         value: float) -> Recipe:
        """``recipe`` with ``key`` (one of :attr:`entry_knobs`) set to ``value`` in its
        own entry ``index``, or in every entry (None)."""
        raise NotImplementedError(f"merge method {self.name!r} has no entries of its own")

    def language_model(self, recipe: Recipe) -> str | None:
        """The target-language model the merge builds on (a sweep's constraint may be
        relative to it; ``evaluate_inputs`` scores it): the model with ``role:
        language`` (layer swapping), else the last of ``models`` besides the base (where
        the named form puts the language base)."""
        models = [m for m in recipe.models if m.model != recipe.base_model]
        for m in models:
            if m.parameters.get("role") == "language":
                return m.model
        return models[-1].model if models else None

    def donors(self, recipe: Recipe) -> list[str]:
        """The models whose abilities the merge adds (``evaluate_inputs`` scores each):
        every model besides the base and the language model."""
        lang = self.language_model(recipe)
        return [m.model for m in recipe.models if m.model not in (recipe.base_model, lang)]

    def held_input(self, recipe: Recipe) -> str | None:
        """An input every candidate of a sweep reads whole, worth holding in memory once
        for all of them (a reference as the recipe gives it); None: none."""
        return None

    def commands(self) -> list[click.Command]:
        """The method's own commands of the ``maec`` command line (none by default)."""
        return []

    def per_model_keys(self) -> set[str]:
        """Named-form parameters that are split over the models (the rest are global)."""
        return set(self.model_params.model_fields)

    def named_form(self, form: NamedForm) -> dict[str, Any]:
        """The recipe (as data for ``parse_recipe``) a named body asks for.

        The default: models are the ability donors, then the language base, merged onto
        ``base``; per-model parameters are split over them.
        """
        for other in _REGISTRY.values():
            if other is not self:
                other.refuse_own_named_inputs(form, self.name)
        params = dict(form.parameters)
        names = [*form.ability_donor, form.language_base]
        model_params: list[dict[str, Any]] = [{} for _ in names]
        for key in sorted(self.per_model_keys() & set(params)):
            for i, v in enumerate(per_model(params.pop(key), len(names), key)):
                model_params[i][key] = v
        return {
            "merge_method": self.name, "base_model": form.base,
            "models": [{"model": n, "parameters": p}
                       for n, p in zip(names, model_params, strict=True)],
            "parameters": params,
        }


class TensorMethod(MergeMethod):
    """A method the engine runs tensor by tensor through :meth:`merge`."""

    # Each output entry depends only on the same entry of the inputs (and on the
    # tensor's name), so the engine may call ``merge`` on flat slices of a tensor.
    elementwise: ClassVar[bool] = False

    @classmethod
    def _check_complete(cls) -> None:
        super()._check_complete()
        if cls.merge is TensorMethod.merge:
            raise TypeError(f"tensor method {cls.name!r} does not define merge()")

    def merge(self, call: TensorCall) -> torch.Tensor:
        """The merged tensor for one call (may reuse the call's input tensors)."""
        raise NotImplementedError  # every registered subclass overrides it (checked above)

    def merge_into(self, call: TensorCall, out: torch.Tensor, compute: torch.dtype
                   ) -> bool | None:
        """An element-wise method's fast path on the engine's CPU stream: :meth:`merge`
        of ``call`` in the ``compute`` dtype, written into ``out`` (flat, the output
        dtype), the same bytes. Unlike :meth:`merge`'s, the call's tensors are flat
        slices in their stored dtype, read-only. Returns whether every entry of ``out``
        is finite, or None when it cannot take the call (``out`` untouched; the engine
        then uses :meth:`merge`). The default takes none."""
        return None

    def kernel(self, call: TensorCall, compute: str) -> Kernel | None:
        """An element-wise method's compiled kernel for one tensor, chosen without torch:
        ``kernel(inputs, out)`` computes :meth:`merge` in the ``compute`` dtype (its
        name) from flat runs of the stored inputs (the base first, then the models) into
        ``out``, the same bytes, and returns whether every entry is finite, or None when
        it cannot take them. ``call`` names the tensor and holds its parameters, no
        tensors. None (the default): no kernel for this call; a merge whose every tensor
        has one runs without importing torch (``maec_core.kernel_merge``)."""
        return None

    def first_pass(self, call: TensorCall, compute: torch.dtype) -> FirstPass | None:
        """For a method with a per-tensor reduction, on the engine's CPU stream in a
        16-bit ``compute`` dtype: the reduction as a pass over flat slices, whose result
        the slices' :meth:`merge` calls then get as ``call.reduced`` (the same bytes as a
        whole-tensor merge). ``call`` holds no tensors. None (the default): whole tensors.
        """
        return None
