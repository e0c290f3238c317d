"""Recipes: mergekit's YAML shape, and a method's own top-level keys through its inputs model.

This package is the recipe model and nothing that runs it: its parts (parameter values,
the ``sweep:`` block, the chat template) sit here together, below every module that
plans, merges, evaluates or sweeps a recipe (the ``core-floors`` import contract).

Torch-free: the API validates job bodies with these models before anything is queued.
Unknown keys inside a recipe's blocks are errors that name the key. An unknown top-level
key is accepted, as mergekit 0.1.5 accepts it (it ignores it), and reported as a warning
(:meth:`Recipe.recipe_warnings`): model-card recipes carry misspelled keys that mergekit
never read, and refusing them would refuse merges mergekit runs.

No method's inputs are fields here: a method that reads top-level keys of its own
declares them (:mod:`maec_core.recipe.inputs`), and the recipe of that method takes them
through that model, checked as strictly as its own fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from maec_core.errors import EvalSetError, MaecError, RecipeError, SweepError
from maec_core.eval.sets import MAX_SETS, EvalSetSpec
from maec_core.recipe.chat_template import check_chat_template
from maec_core.recipe.inputs import MethodInputs, SourceRef, SourceRole, inputs_models, owned_keys
from maec_core.recipe.sweep import SweepSpec
from maec_core.recipe.values import ParamValue

DType = Literal["float32", "float16", "bfloat16"]


def _empty_if_none(v: Any) -> Any:
    # A bare ``parameters:`` (YAML null), as mergekit's own examples write it: no
    # parameters, as mergekit reads it.
    return {} if v is None else v


class ModelEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    parameters: dict[str, ParamValue] = Field(default_factory=dict)

    _params = field_validator("parameters", mode="before")(_empty_if_none)


class SliceSource(BaseModel):
    """One model's run of layers ``[start, end)`` in a slice (mergekit's slice source)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    layer_range: tuple[int, int]
    parameters: dict[str, ParamValue] = Field(default_factory=dict)

    _params = field_validator("parameters", mode="before")(_empty_if_none)

    @field_validator("layer_range")
    @classmethod
    def _ordered(cls, v: tuple[int, int]) -> tuple[int, int]:
        if v[0] < 0 or v[1] <= v[0]:
            raise ValueError(f"layer_range {list(v)} must be [start, end) with 0 <= start < end")
        return v

    @property
    def length(self) -> int:
        return self.layer_range[1] - self.layer_range[0]


class Slice(BaseModel):
    """A run of output layers: its sources' layers merged with the recipe's method.

    Every source spans the same number of layers; output layers are numbered on from the
    previous slice's, so slices may repeat or drop layers (a frankenmerge).
    """

    model_config = ConfigDict(extra="forbid")

    sources: list[SliceSource] = Field(min_length=1)
    parameters: dict[str, ParamValue] = Field(default_factory=dict)

    _params = field_validator("parameters", mode="before")(_empty_if_none)

    @model_validator(mode="after")
    def _same_length(self) -> Slice:
        lengths = {s.length for s in self.sources}
        if len(lengths) > 1:
            raise ValueError("every source of a slice must span the same number of layers "
                             f"(got {sorted(lengths)})")
        models = [s.model for s in self.sources]
        twice = sorted({m for m in models if models.count(m) > 1})
        if twice:
            # Sources are told apart by model (as in mergekit): one model once per slice.
            raise ValueError(f"a slice names {twice[0]!r} twice")
        return self

    @property
    def length(self) -> int:
        return self.sources[0].length


class ModuleSpec(BaseModel):
    """One module of a multi-module model (mergekit's ``modules:`` entry, e.g. a VLM's
    ``text_decoder``, ``vision_tower`` and ``multi_modal_projector``): its output layers
    as ``slices``, or ``models`` merged over every layer of the module. ``parameters``
    sit between a slice's and the recipe's in the lookup order."""

    model_config = ConfigDict(extra="forbid")

    slices: list[Slice] | None = None
    models: list[ModelEntry] | None = None
    parameters: dict[str, ParamValue] = Field(default_factory=dict)

    _params = field_validator("parameters", mode="before")(_empty_if_none)

    @model_validator(mode="after")
    def _one_form(self) -> ModuleSpec:
        if bool(self.slices) == bool(self.models):
            raise ValueError("a module takes either slices or models (one of them, "
                             "not empty)")
        return self


@dataclass(frozen=True)
class LaidSlice:
    """One run of output layers of a slices or modules recipe, with where it sits.

    ``slice`` is None for a module given as ``models`` (every layer of the module, which
    the plan counts from the checkpoints); ``sources`` are then those models'.
    """

    where: str
    module: str | None
    slice: Slice | None
    models: tuple[ModelEntry, ...] = ()
    module_parameters: Mapping[str, ParamValue] = field(default_factory=dict)

    @property
    def sources(self) -> list[tuple[str, Mapping[str, ParamValue]]]:
        """(model, its parameters) of every source, in order."""
        if self.slice is not None:
            return [(s.model, s.parameters) for s in self.slice.sources]
        return [(m.model, m.parameters) for m in self.models]

    @property
    def parameters(self) -> Mapping[str, ParamValue]:
        return self.slice.parameters if self.slice is not None else {}

    def source_where(self, j: int) -> str:
        """Where source ``j`` sits: ``<slice>.sources[j]`` or ``<module>.models[j]``."""
        return f"{self.where}.{'sources' if self.slice is not None else 'models'}[{j}]"


class ZeroEmbedding(BaseModel):
    """A token's rows are zeros (mergekit's ``{kind: zero}``)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["zero"]


class ModelTokenEmbedding(BaseModel):
    """A token's rows are those of one token of one model, named by id or by string."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["model_token"]
    model: str
    token_id: int | None = None
    token: str | None = None

    @model_validator(mode="after")
    def _one_token(self) -> ModelTokenEmbedding:
        if (self.token_id is None) == (self.token is None):
            raise ValueError("give exactly one of token_id or token")
        return self


class TokenEmbedding(BaseModel):
    """Where one output token's embedding and LM-head rows come from (mergekit's shape):
    a model (its own row for that token), a model's other token, or zeros. ``force``
    uses it even for models that have the token."""

    model_config = ConfigDict(extra="forbid")

    source: ModelTokenEmbedding | ZeroEmbedding | str | None = None
    force: bool = False


class TokenizerSpec(BaseModel):
    """mergekit's ``tokenizer:`` block: the output vocabulary and per-token overrides."""

    model_config = ConfigDict(extra="forbid")

    source: str = "union"
    tokens: dict[str, TokenEmbedding] = Field(default_factory=dict)
    pad_to_multiple_of: int | None = Field(default=None, ge=1)


class OutputFormat(BaseModel):
    """What a merge publishes: the merged checkpoint (``model``), or a PEFT LoRA adapter
    of rank ``rank`` approximating the merge's change to its base (``lora``)."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["model", "lora"] = "model"
    # Also publish the merged model as one GGUF file of this type (docs/gguf.md).
    gguf: str | None = None
    rank: int | None = Field(default=None, ge=1, le=65536)
    # Module names as peft matches them (a name, or a name's last dotted parts); None:
    # every 2-D weight inside the transformer blocks.
    target_modules: list[str] | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _lora_fields(self) -> OutputFormat:
        if self.format == "lora" and self.rank is None:
            raise ValueError("output format lora needs a rank")
        if self.format == "model" and (self.rank is not None or self.target_modules):
            raise ValueError("output rank and target_modules apply to format lora only")
        if self.gguf is not None and self.format == "lora":
            raise ValueError("output gguf applies to format model only")
        return self


__all__ = ["MethodInputs", "SourceRef", "SourceRole"]


class Recipe(BaseModel):
    # A top-level key no field reads is kept (``model_extra``), as mergekit's model keeps
    # it, and never read: reported by :meth:`recipe_warnings`, recorded with the recipe.
    model_config = ConfigDict(extra="allow")

    merge_method: str
    base_model: str | None = None
    models: list[ModelEntry] = Field(default_factory=list)
    # mergekit's other shape: runs of layers, each merged from its own sources.
    slices: list[Slice] | None = None
    # mergekit's shape for multi-module models (VLMs): slices or models per module.
    modules: dict[str, ModuleSpec] | None = None
    parameters: dict[str, ParamValue] = Field(default_factory=dict)
    _params = field_validator("parameters", mode="before")(_empty_if_none)
    # mergekit: ``dtype`` is the compute dtype and ``out_dtype`` the saved one (``dtype``
    # too when absent). MAEC, and an engine told ``compute_dtype="float32"``, compute in
    # float32 whatever ``dtype`` says.
    dtype: DType | None = None
    out_dtype: DType | None = None
    # mergekit: "base" or a model path whose tokenizer files are copied.
    tokenizer_source: str | None = None
    # mergekit's fuller form: source plus per-token overrides and padding.
    tokenizer: TokenizerSpec | None = None
    out_shard_size: int | str = "5GB"
    name: str | None = None
    # mergekit's: a built-in template's name, literal Jinja, or "auto" (the template
    # most inputs carry); written beside the output's tokenizer.
    chat_template: str | None = Field(default=None, max_length=1 << 20)
    output: OutputFormat | None = None
    # Evaluation and sweeps: what the job does with the merged model (the merge itself
    # ignores them). Eval set paths are sources, like the checkpoints'.
    evaluate: list[EvalSetSpec] | None = Field(default=None, min_length=1,
                                                max_length=MAX_SETS)
    evaluate_inputs: bool | None = None
    sweep: SweepSpec | None = None
    # The recipe's method's own top-level keys, checked by its inputs model (None: the
    # method declares none).
    _inputs: MethodInputs | None = PrivateAttr(default=None)

    @field_validator("merge_method")
    @classmethod
    def _lower(cls, v: str) -> str:
        return v.strip().lower()

    @field_validator("chat_template")
    @classmethod
    def _template(cls, v: str | None) -> str | None:
        if v is not None:
            check_chat_template(v)
        return v

    @model_validator(mode="after")
    def _method_inputs(self) -> Recipe:
        # First of the checks on the whole recipe: the others may ask the inputs (the
        # LoRA export's base). A key another method owns, given with that method's
        # default, is what recipe.yaml spells out (see _ordered): dropped, as the
        # recipe had it when those keys were its fields; given otherwise, it stays an
        # unknown key for its owner to refuse (MergeMethod.refuse_own_inputs).
        models = inputs_models()
        extra = self.__pydantic_extra__ if self.__pydantic_extra__ is not None else {}
        own = models.get(self.merge_method)
        if own is not None:
            self._inputs = own.model_validate({k: extra.pop(k) for k in list(extra)
                                               if k in own.model_fields})
        others = {m: model for m, model in models.items() if m != self.merge_method}
        for key, method in owned_keys(others).items():
            if key in extra and extra[key] == _defaults(others[method]).get(key):
                del extra[key]
        return self

    @model_serializer(mode="wrap")
    def _ordered(self, handler: SerializerFunctionWrapHandler,
                 info: SerializationInfo) -> dict[str, Any]:
        """The fields in their order, with every method's own keys where they sat when
        they were fields of the recipe (before ``output``): the recipe's method's
        values, the other methods' defaults. recipe.yaml and the recorded recipe keep
        the bytes they had."""
        data: dict[str, Any] = handler(self)
        fields = list(type(self).model_fields)
        head = fields[:fields.index("output")]
        slot: dict[str, Any] = {}
        for method, model in inputs_models().items():
            given = self._inputs if method == self.merge_method else None
            inputs = given if given is not None else model.model_construct(**_defaults(model))
            slot.update(inputs.model_dump(mode=info.mode, exclude_none=info.exclude_none,
                                          by_alias=bool(info.by_alias),
                                          include=set(_defaults(model)) if given is None
                                          else None))
        slot = {k: v for k, v in slot.items() if k not in data}
        return ({k: v for k, v in data.items() if k in head} | slot
                | {k: v for k, v in data.items() if k not in head})

    @property
    def method_inputs(self) -> MethodInputs | None:
        """The recipe's method's own top-level keys, as its inputs model checked them
        (None: the method declares none)."""
        return self._inputs

    def with_inputs(self, inputs: MethodInputs) -> Recipe:
        """A copy with the method's own keys replaced by ``inputs`` (its inputs model)."""
        copy = self.model_copy()
        copy._inputs = inputs
        return copy

    @model_validator(mode="after")
    def _one_shape(self) -> Recipe:
        if self.modules is not None:
            if not self.modules:
                raise ValueError("modules is empty; give at least one module")
            if self.models or self.slices is not None:
                raise ValueError("give one of models, slices or modules")
        if self.slices is not None and not self.slices:
            raise ValueError("slices is empty; give at least one slice")
        if self.slices is not None and self.models:
            raise ValueError("give either models or slices, not both")
        # Rows are remapped by token only for models recipes.
        if self.layered and (self.tokenizer is not None or self.tokenizer_source == "union"):
            shape = "slices" if self.slices is not None else "modules"
            raise ValueError(f"a {shape} recipe takes tokenizer_source 'base' or a model, "
                             "not a union vocabulary or tokenizer settings")
        if self.tokenizer is not None and self.tokenizer_source is not None:
            raise ValueError("give either tokenizer_source or tokenizer.source, not both")
        if self.output is not None and self.output.format == "lora":
            self._check_lora_output()
        return self

    def _check_lora_output(self) -> None:
        # The adapter is the merge's change to one base, tensor for tensor.
        if self.layered:
            raise ValueError("output format lora needs a merge that keeps its base's "
                             "tensors; a slices recipe changes them")
        if self.lora_base is None:
            raise ValueError("output format lora needs a base to take the delta from: "
                             "base_model (language_base for maec)")

    @model_validator(mode="after")
    def _evaluation(self) -> Recipe:
        sets = {s.name: s for s in self.evaluate or []}
        if len(sets) != len(self.evaluate or []):
            raise ValueError("evaluate: two eval sets have the same name")
        if self.evaluate_inputs and not sets:
            raise ValueError("evaluate_inputs needs evaluate (the eval sets)")
        if self.sweep is not None:
            for use, target in (("objective", self.sweep.objective),
                                ("constraint", self.sweep.constraint),
                                ("tie_break", self.sweep.tie_break)):
                if target is None:
                    continue
                found = sets.get(target.set)
                if found is None:
                    raise ValueError(f"sweep.{use}.set {target.set!r} is not one of the "
                                     f"eval sets ({', '.join(sets) or 'evaluate is empty'})")
                measures = found.metric if found.kind == "lm_eval" else found.kind
                if measures is None:
                    raise ValueError(f"sweep.{use}: give eval set {target.set!r} the lm-eval "
                                     f"metric to compare (metric: {target.metric})")
                if measures != target.metric:
                    raise ValueError(f"sweep.{use}: eval set {target.set!r} measures "
                                     f"{measures}, not {target.metric}")
        return self

    def recipe_warnings(self) -> list[str]:
        """What the recipe itself gives that no merge reads, one line each (the methods
        add the parameters they do not read): unknown top-level keys, a tokenizer donor,
        and ``modules: default`` (mergekit's name for the whole of a one-stack model)."""
        out = [f"{key} ignored: not a recipe field (mergekit 0.1.5 ignores it too)"
               for key in sorted(self.model_extra or {})]
        if self.tokenizer_donor is not None:
            out.append(f"tokenizer source {self.tokenizer_donor} is not merged: the output "
                       "takes its tokenizer (a tokenizer donor, fetched as an input); tokens "
                       "no merged model has get zero rows")
        if self.modules is not None and "default" in self.modules:
            out.append("modules.default read as the whole model: mergekit's one module of "
                       "a one-stack architecture (the same merge as slices or models)")
        return out

    @property
    def layered(self) -> bool:
        """Whether the recipe lays out its output layers (slices or modules)."""
        return self.slices is not None or self.modules is not None

    def laid_slices(self) -> list[LaidSlice]:
        """Every run of output layers, top-level slices then each module's, in order."""
        out = [LaidSlice(f"slices[{i}]", None, sl) for i, sl in enumerate(self.slices or [])]
        for name, mod in (self.modules or {}).items():
            if mod.models:
                out.append(LaidSlice(f"modules.{name}", name, None, tuple(mod.models),
                                     mod.parameters))
            out += [LaidSlice(f"modules.{name}.slices[{i}]", name, sl,
                              module_parameters=mod.parameters)
                    for i, sl in enumerate(mod.slices or [])]
        return out

    def parameter_blocks(self) -> list[tuple[str, Mapping[str, ParamValue], bool]]:
        """Every parameter block, in recipe order: (where it sits, its values, whether
        it belongs to one model: a ``models`` entry or a slice source)."""
        out: list[tuple[str, Mapping[str, ParamValue], bool]] = [
            ("parameters", self.parameters, False)]
        out += [(f"models[{i}].parameters", m.parameters, True)
                for i, m in enumerate(self.models)]
        out += [(f"modules.{name}.parameters", mod.parameters, False)
                for name, mod in (self.modules or {}).items()]
        for laid in self.laid_slices():
            if laid.slice is not None:
                out.append((f"{laid.where}.parameters", laid.slice.parameters, False))
            out += [(f"{laid.source_where(j)}.parameters", params, True)
                    for j, (_, params) in enumerate(laid.sources)]
        return out

    def merge_only(self) -> Recipe:
        """This recipe without evaluation and sweep: what one merge runs."""
        return self.model_copy(update={"evaluate": None, "evaluate_inputs": None,
                                       "sweep": None})

    @property
    def lora_base(self) -> str | None:
        """The checkpoint a LoRA export's adapter applies to: the language base of a
        method built on one (validation refuses a language_base to any other), else the
        base model."""
        built_on = self._inputs.builds_on() if self._inputs is not None else None
        return built_on if built_on is not None else self.base_model

    @property
    def vocab_source(self) -> str | None:
        """Where the output vocabulary comes from: ``base``, ``union``, a model, or None
        (no vocabulary merge: every input must have the same one)."""
        return self.tokenizer.source if self.tokenizer is not None else self.tokenizer_source

    @property
    def tokenizer_donor(self) -> str | None:
        """The checkpoint the output vocabulary comes from when none of its weights are
        merged (mergekit's ``tokenizer_source`` naming another model: a tokenizer
        donor), else None. It is an input of its own: fetched, pinned, its tokenizer
        read."""
        src = self.vocab_source
        if src is None or src in ("base", "union"):
            return None
        merged = {s.ref for s in self.sources() if s.kind == "checkpoint"}
        return None if src in merged else src

    def _tokenizer_refs(self) -> list[str]:
        """Checkpoint references the tokenizer settings name (never separate inputs)."""
        src = self.vocab_source
        refs = [src] if src is not None and src not in ("base", "union") else []
        for cfg in (self.tokenizer.tokens.values() if self.tokenizer is not None else ()):
            if isinstance(cfg.source, str):
                refs.append(cfg.source)
            elif isinstance(cfg.source, ModelTokenEmbedding):
                refs.append(cfg.source.model)
        return refs

    @property
    def output_dtype(self) -> DType | None:
        """The dtype to save (None: the inputs' dtype)."""
        return self.out_dtype or self.dtype

    def shard_size_bytes(self) -> int:
        return parse_size(self.out_shard_size)

    def sources(self) -> list[SourceRef]:
        """Every checkpoint and corpus reference, in recipe order (base first).

        The one place that knows where references sit in a recipe: the API resolves
        these, the worker fetches them and rewrites them with :meth:`with_sources`.
        ``tokenizer_source: base`` and ``union`` are keywords, not references.
        """
        own = self._inputs.sources() if self._inputs is not None else []
        out: list[SourceRef] = []
        if self.base_model is not None:
            out.append(SourceRef("base", self.base_model))
        out += [s for s in own if s.index is None]
        out += [SourceRef("model", m.model, i) for i, m in enumerate(self.models)]
        for i, laid in enumerate(self.laid_slices()):
            out += [SourceRef("slice_source", m, i, j) for j, (m, _) in enumerate(laid.sources)]
        out += [s for s in own if s.index is not None]
        out += [SourceRef("tokenizer", ref) for ref in self._tokenizer_refs()]
        return out

    def with_sources(self, mapping: Mapping[str, str]) -> Recipe:
        """A copy with every reference found in ``mapping`` replaced by its value."""

        def sub(ref: str | None) -> str | None:
            return mapping.get(ref, ref) if ref is not None else None

        def sub_source(ref: str | None) -> str | None:
            return ref if ref in ("base", "union") else sub(ref)

        copy = self.model_copy(update={
            "base_model": sub(self.base_model),
            "tokenizer_source": sub_source(self.tokenizer_source),
            "tokenizer": None if self.tokenizer is None else _sub_tokenizer(self.tokenizer,
                                                                             mapping),
            "models": [m.model_copy(update={"model": mapping.get(m.model, m.model)})
                       for m in self.models],
            "slices": None if self.slices is None else [
                _sub_slice(sl, mapping) for sl in self.slices],
            "modules": None if self.modules is None else {
                name: mod.model_copy(update={
                    "slices": None if mod.slices is None else [
                        _sub_slice(sl, mapping) for sl in mod.slices],
                    "models": None if mod.models is None else [
                        m.model_copy(update={"model": mapping.get(m.model, m.model)})
                        for m in mod.models]})
                for name, mod in self.modules.items()},
        })
        return copy if self._inputs is None else copy.with_inputs(
            self._inputs.with_sources(mapping))

    def to_yaml(self) -> str:
        """The recipe as YAML with every field spelled out (for recipe.yaml outputs)."""
        data = self.model_dump(mode="json", exclude_none=True)
        return yaml.safe_dump(data, sort_keys=False)


def _defaults(model: type[MethodInputs]) -> dict[str, Any]:
    """The keys of ``model`` that have a default, with it."""
    return {k: f.get_default(call_default_factory=True)
            for k, f in model.model_fields.items() if not f.is_required()}


def _sub_slice(sl: Slice, mapping: Mapping[str, str]) -> Slice:
    return sl.model_copy(update={"sources": [
        s.model_copy(update={"model": mapping.get(s.model, s.model)}) for s in sl.sources]})


def _sub_tokenizer(spec: TokenizerSpec, mapping: Mapping[str, str]) -> TokenizerSpec:
    """``spec`` with every checkpoint reference found in ``mapping`` replaced."""
    def sub(cfg: TokenEmbedding) -> TokenEmbedding:
        src = cfg.source
        if isinstance(src, str):
            return cfg.model_copy(update={"source": mapping.get(src, src)})
        if isinstance(src, ModelTokenEmbedding):
            return cfg.model_copy(update={"source": src.model_copy(
                update={"model": mapping.get(src.model, src.model)})})
        return cfg

    source = spec.source if spec.source in ("base", "union") else mapping.get(spec.source,
                                                                              spec.source)
    return spec.model_copy(update={"source": source,
                                   "tokens": {t: sub(c) for t, c in spec.tokens.items()}})


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
            # A check on the whole recipe (models vs slices) has no field to name.
            msg = str(err["msg"]).removeprefix("Value error, ")
            problems.append(f"{where}: {msg}" if where else msg)
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


def load_recipe(source: Recipe | Mapping[str, Any] | str | Path) -> Recipe:
    """Load the recipe data model from a model, a mapping, a YAML file path, or YAML
    text: its shape and fields checked, not yet what its method makes of them
    (:func:`maec_core.parsing.parse_recipe` checks both; this model knows no method)."""
    if isinstance(source, Recipe):
        return source
    data = read_yaml(source, "recipe")
    if not isinstance(data, dict):
        raise RecipeError("recipe must be a YAML mapping")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise _explain(exc) from None
    return recipe


def read_yaml(source: Mapping[str, Any] | str | Path, what: str) -> Any:
    """The document ``source`` holds: a mapping as it is, a YAML file's path (a ``Path``,
    or one line ending ``.yaml``/``.yml``), or YAML text; ``what`` names it in errors
    (RecipeError). Shared by recipes and MoE configs."""
    if isinstance(source, Mapping):
        return dict(source)
    text: str
    if isinstance(source, Path) or ("\n" not in source and source.endswith((".yaml", ".yml"))):
        try:
            text = Path(source).read_text()
        except OSError as exc:
            raise RecipeError(f"cannot read {what} {source}: {exc.strerror}") from None
    else:
        text = str(source)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError(f"{what} is not valid YAML: {exc}") from None
