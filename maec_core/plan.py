"""The plan: decide, from configs and headers alone, which tensors a merge reads and writes.

Runs before any tensor data is touched (and in the API process, which has no torch), so
a vocab mismatch or a quantized donor fails in milliseconds instead of after a download
and a 20-minute merge.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from maec_core.accounting import TIED_LM_HEAD
from maec_core.errors import IncompatibleCheckpoints, RecipeError, UnsupportedDtype
from maec_core.io.folder import ModelFolder, open_model_folder
from maec_core.io.headers import FLOAT_DTYPES, TensorInfo
from maec_core.methods.params import BLOCK_PATTERN
from maec_core.methods.registry import get_method
from maec_core.model_modules import MODULAR, ModuleLayout, module_layouts, module_of
from maec_core.recipe import LaidSlice, Recipe, Slice, SliceSource
from maec_core.vocab.build import (
    VocabPlan,
    VocabSpec,
    embedding_rows,
    is_vocab_tensor,
    plan_vocab,
)
from maec_core.vocab.tokens import read_vocab

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
# Config fields whose disagreement means "not the same architecture", reported by name
# before any per-tensor comparison so the message says what the user got wrong.
ARCH_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)
DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclass(frozen=True)
class PlannedTensor:
    """One output tensor and where every input holds it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    sources: dict[str, TensorInfo]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class MergePlan:
    models: dict[str, ModelFolder]
    reference: str
    tensors: list[PlannedTensor]
    # Fields of the reference config the output changes (a slices recipe's layer count).
    config_updates: dict[str, Any] = field(default_factory=dict)
    # Input tensors the recipe leaves out, with why: model key -> tensor -> reason. Every
    # other stored tensor of every model must be read for some output tensor
    # (maec_core.accounting checks it before a merge writes anything).
    left_out: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # What the plan does that the checkpoints' headers decided and the recipe does not
    # say, one line each (logged by the engine, listed in a job's warnings).
    notes: tuple[str, ...] = ()

    @property
    def input_dtype(self) -> str:
        """The reference model's weight dtype as a torch name (the default output dtype)."""
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel
        return DTYPE_NAMES[max(counts, key=lambda k: counts[k])]

    @property
    def num_layers(self) -> int:
        return config_layers(self.models[self.reference].config)


def _lookup(folder: ModelFolder, name: str) -> TensorInfo | None:
    info = folder.tensors.get(name)
    if info is None and name == LM_HEAD and folder.tie_word_embeddings:
        # Tied checkpoints (Llama-3.2, Gemma) store only the embedding; lm_head is it.
        info = folder.tensors.get(EMBED)
    return info


def tensor_of(folder: ModelFolder, name: str) -> TensorInfo | None:
    """The stored tensor ``folder`` gives for the planned tensor ``name`` (a tied
    checkpoint's embedding for lm_head), or None."""
    return _lookup(folder, name)


def _check_input(
    info: TensorInfo, reference: str, other: TensorInfo, key: str, name: str,
    by_token: bool = False,
) -> None:
    """``other`` (input ``key``'s tensor ``name``) can be merged into ``info`` (the
    reference's); ``by_token``: rows are matched by token, only the other axes must
    agree."""
    if other.dtype not in FLOAT_DTYPES:
        # Checked per input, not only on the reference: a quantized donor must be
        # named as such, not reported as a dtype mismatch.
        raise UnsupportedDtype(
            f"{key}: tensor {name!r} is {other.dtype}; only F16, BF16 and F32 "
            "safetensors can be merged (quantized checkpoints are not supported)",
            tensor=name,
            model=key,
            dtype=other.dtype,
        )
    if (other.shape[1:] != info.shape[1:]) if by_token else (other.shape != info.shape):
        raise IncompatibleCheckpoints(
            f"tensor {info.name!r} has shape {list(info.shape)} in {reference} "
            f"but {list(other.shape)} in {key}",
            tensor=info.name,
            shapes={reference: list(info.shape), key: list(other.shape)},
        )
    if other.dtype != info.dtype:
        raise IncompatibleCheckpoints(
            f"tensor {info.name!r} is {info.dtype} in {reference} "
            f"but {other.dtype} in {key}",
            tensor=info.name,
            dtypes={reference: info.dtype, key: other.dtype},
        )


def check_configs(
    models: Mapping[str, ModelFolder], fields: tuple[str, ...] = ARCH_FIELDS
) -> None:
    """Compare architecture fields across configs and name the first disagreement."""
    for fld in fields:
        values = {key: m.config.get(fld) for key, m in models.items()}
        present = {k: v for k, v in values.items() if v is not None}
        if len(set(map(repr, present.values()))) > 1:
            what = "vocab size" if fld == "vocab_size" else fld
            listing = ", ".join(f"{k}={v}" for k, v in present.items())
            fix = ("; set tokenizer_source ('base', 'union' or a model; for MAEC the "
                   "language base) to merge the embeddings token by token"
                   if fld == "vocab_size" else "")
            raise IncompatibleCheckpoints(
                f"{what} differs between checkpoints: {listing}{fix}", field=fld,
                values=present,
            )


def build_plan(
    models: Mapping[str, ModelFolder], reference: str, vocab_rows: int | None = None
) -> MergePlan:
    """Check that all ``models`` share tensor names, shapes and dtypes; return the plan.

    ``reference`` names the model whose tensor set and file layout the output follows.
    With ``vocab_rows`` (rows are matched by token: a vocabulary merge) the embedding
    and LM head may differ in rows between inputs; the output has ``vocab_rows``.
    """
    check_configs(models, ARCH_FIELDS if vocab_rows is None
                  else tuple(f for f in ARCH_FIELDS if f != "vocab_size"))
    ref = models[reference]
    ordered = sorted(
        ref.tensors.values(),
        key=lambda t: (ref.weight_files.index(t.file), t.start),
    )
    planned: list[PlannedTensor] = []
    for info in ordered:
        if info.dtype not in FLOAT_DTYPES:
            raise UnsupportedDtype(
                f"{reference}: tensor {info.name!r} is {info.dtype}; only F16, BF16 and F32 "
                "safetensors can be merged (quantized checkpoints are not supported)",
                tensor=info.name,
                model=reference,
                dtype=info.dtype,
            )
        sources = {}
        by_token = vocab_rows is not None and is_vocab_tensor(info.name)
        for key, folder in models.items():
            other = _lookup(folder, info.name)
            if other is None:
                raise IncompatibleCheckpoints(
                    f"tensor {info.name!r} is in {reference} but missing from {key}",
                    tensor=info.name,
                    models=[reference, key],
                )
            _check_input(info, reference, other, key, info.name, by_token)
            sources[key] = other
        shape = (vocab_rows, *info.shape[1:]) if by_token and vocab_rows else info.shape
        planned.append(PlannedTensor(info.name, shape, info.dtype, sources))
    ref_names = {t.name for t in planned}
    left_out: dict[str, dict[str, str]] = {}
    for key, folder in models.items():
        for name in folder.tensors:
            if name in ref_names:
                continue
            if name == LM_HEAD and ref.tie_word_embeddings:
                # The output ties its head to the embedding (as the reference does).
                left_out.setdefault(key, {})[name] = TIED_LM_HEAD
                continue
            raise IncompatibleCheckpoints(
                f"tensor {name!r} is in {key} but missing from {reference}",
                tensor=name,
                models=[key, reference],
            )
    return MergePlan(dict(models), reference, planned,
                     vocab_config(ref.config, vocab_rows) if vocab_rows else {}, left_out)


def vocab_config(config: Mapping[str, Any], rows: int) -> dict[str, Any]:
    """The output config's vocab_size (top level, or its text model's)."""
    if "vocab_size" in config or "text_config" not in config:
        return {"vocab_size": rows}
    return {"text_config": {**config["text_config"], "vocab_size": rows}}


def plan_recipe(recipe: Recipe, models: Mapping[str, ModelFolder]) -> MergePlan:
    """The plan for ``recipe`` over ``models`` (keyed by the recipe's references).

    A models recipe follows its base (or first) model tensor for tensor; a slices recipe
    is planned by :func:`build_slice_plan`. Header-only: the API calls this to reject an
    impossible recipe before anything is queued.
    """
    if recipe.layered:
        return build_slice_plan(recipe, models).plan
    keys = _distinct(recipe)
    folders = {k: models[k] for k in keys}
    # A method that decides the output's vocabulary itself (MAEC: its language base's)
    # says so; otherwise the recipe's tokenizer settings do.
    own = get_method(recipe.merge_method).own_vocab(recipe, folders)
    if own is not None:
        return build_plan(folders, keys[0], own.rows)
    vocab = recipe_vocab(recipe, folders, models)
    return build_plan(folders, keys[0], rows_of(vocab))


def recipe_vocab(recipe: Recipe, folders: Mapping[str, ModelFolder],
                 donors: Mapping[str, ModelFolder] | None = None) -> VocabPlan | None:
    """The vocabulary plan of a models recipe over ``folders`` (the merged checkpoints)
    keyed by reference (None without tokenizer settings). A tokenizer donor (the source
    naming a checkpoint that is not merged) is taken from ``donors`` when it is there
    (the API's header views), else opened from its path (its tokenizer is all that is
    read)."""
    spec = VocabSpec.of(recipe)
    if spec is None:
        return None
    donor = None
    if recipe.tokenizer_donor is not None:
        found = (donors or {}).get(spec.source)
        donor = found if found is not None else open_model_folder(spec.source)
    return plan_vocab(spec, folders, base=recipe.base_model, refs={k: k for k in folders},
                      donor=donor)


def rows_of(vocab: VocabPlan | None) -> int | None:
    """Output vocabulary rows when inputs' rows must be remapped (None: nothing to do)."""
    return None if vocab is None or vocab.identity else vocab.rows


def _distinct(recipe: Recipe) -> list[str]:
    return list(dict.fromkeys(s.ref for s in recipe.sources() if s.kind == "checkpoint"))


# Transformer blocks: "<stack>.<i>.<rest>", the stack named as the architectures
# mergekit knows name theirs: "model.layers" (Llama, Mistral, Qwen2, Gemma, Phi,
# Granite), "language_model.model.layers" (Llava-style), "transformer.h" (GPT-2,
# Falcon, BLOOM), "gpt_neox.layers".
_BLOCK = re.compile(BLOCK_PATTERN)
# Tensors outside the blocks that sit below them (the token and position embeddings:
# "embed_tokens", GPT-2's "wte" and "wpe"); every other one (final norm, lm_head) sits
# above them. The split decides which slice's sources a non-layer tensor is merged
# from, as in mergekit: the first slice's, or the last one's.
_BELOW_BLOCKS = ("embed", ".wte.", ".wpe.")


@dataclass(frozen=True)
class SliceCall:
    """How one output tensor of a slices recipe is merged.

    ``base`` and ``models`` are the plan's model keys read for it (base first when
    present); ``slots`` each model's position among its slice's sources (for its own
    parameters); ``frac`` the depth, 0..1 inside the slice, that gradients use;
    ``names`` the input tensor names, which per-model parameter filters match (as in
    mergekit; the global parameters match the output name).
    """

    slice: int
    base: str | None
    models: tuple[str, ...]
    slots: tuple[int, ...]
    frac: float
    names: tuple[str, ...]  # the tensor read from each of ``keys``
    # A vocabulary tensor whose sources have other rows than the output vocabulary
    # (checkpoints whose vocabularies differ by added tokens): per input in ``keys``
    # order, output row ``i`` is its row ``rows[k][i]``, zeros where that is -1.
    rows: tuple[tuple[int, ...], ...] | None = None

    @property
    def keys(self) -> list[str]:
        return ([self.base] if self.base is not None else []) + list(self.models)


@dataclass(frozen=True)
class SlicePlan:
    plan: MergePlan
    calls: list[SliceCall]  # one per planned tensor, in order
    # The recipe's runs of layers as planned (a module given as models is one slice over
    # all its layers), indexed by ``SliceCall.slice``, and each one's module parameters.
    slices: list[Slice] = field(default_factory=list)
    module_parameters: list[Mapping[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class _Stack:
    """A checkpoint's tensors split into its blocks and the rest."""

    prefix: str
    blocks: dict[int, list[str]]  # layer -> suffixes, in file order
    other: list[str]  # non-block tensors, in file order


def _module_stack(key: str, folder: ModelFolder, module: ModuleLayout,
                  layouts: Mapping[str, ModuleLayout]) -> _Stack:
    """The tensors of ``module`` in ``key``: its blocks and its other tensors."""
    blocks: dict[int, list[str]] = {}
    other: list[str] = []
    for info in _in_file_order(folder):
        if module_of(info.name, layouts) != module.name:
            continue
        if module.block is not None and info.name.startswith(module.block):
            index, dot, rest = info.name[len(module.block):].partition(".")
            if index.isdigit() and dot:
                blocks.setdefault(int(index), []).append("." + rest)
                continue
        other.append(info.name)
    _check_numbered(key, blocks, f"the {module.name} blocks", module=module.name)
    return _Stack(module.block or "", blocks, other)


def _in_file_order(folder: ModelFolder) -> list[TensorInfo]:
    return sorted(folder.tensors.values(),
                  key=lambda t: (folder.weight_files.index(t.file), t.start))


def _check_numbered(key: str, blocks: Mapping[int, list[str]], what: str,
                    **details: Any) -> None:
    """Blocks must be numbered 0..n-1 (IncompatibleCheckpoints otherwise)."""
    if sorted(blocks) != list(range(len(blocks))):
        raise IncompatibleCheckpoints(
            f"{key}: {what} are numbered {sorted(blocks)}, not 0..{len(blocks) - 1}",
            model=key, **details)


def _stack(key: str, folder: ModelFolder) -> _Stack:
    prefixes: set[str] = set()
    blocks: dict[int, list[str]] = {}
    other: list[str] = []
    for info in _in_file_order(folder):
        m = _BLOCK.match(info.name)
        if m is None:
            other.append(info.name)
            continue
        prefixes.add(m.group(1))
        blocks.setdefault(int(m.group(2)), []).append(m.group(3))
    if len(prefixes) != 1:
        found = ", ".join(sorted(prefixes)) or "none"
        raise RecipeError(
            f"slices need one stack of blocks named '<prefix>.layers.<i>.*' or "
            f"'<prefix>.h.<i>.*'; {key} has {found}"
            + (" (a multi-module model: lay out each module under modules:, e.g. "
               "modules: {text_decoder: {slices: [...]}, vision_tower: {models: [...]}})"
               if len(prefixes) > 1 and module_layouts(folder.config) else ""),
            model=key,
        )
    _check_numbered(key, blocks, "blocks")
    return _Stack(prefixes.pop(), blocks, other)


# Names configs give their layer count under (GPT-2's is n_layer).
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def layer_count_key(config: Mapping[str, Any]) -> str | None:
    """The key ``config`` (top level) holds its layer count under, if any."""
    return next((k for k in LAYER_COUNT_KEYS if isinstance(config.get(k), int)), None)


def config_layers(config: Mapping[str, Any]) -> int:
    """The layer count a config declares (top level, or its text model's)."""
    for cfg in (config, config.get("text_config") or {}):
        key = layer_count_key(cfg)
        if key is not None:
            return int(cfg[key])
    return 0


def _check_ranges(laid: list[tuple[str, Slice]], stacks: Mapping[str, _Stack]) -> None:
    for where, sl in laid:
        for j, src in enumerate(sl.sources):
            have = len(stacks[src.model].blocks)
            start, end = src.layer_range
            if end > have:
                raise RecipeError(
                    f"{where}.sources[{j}]: layer_range [{start}, {end}] exceeds the "
                    f"{have} layers of {src.model}",
                    slice=where, source=j, model=src.model, layers=have,
                )


def _gather(
    out_name: str, inputs: list[tuple[str, str]], models: Mapping[str, ModelFolder]
) -> PlannedTensor:
    """The planned tensor ``out_name`` read from ``(key, input name)`` pairs; the first
    pair fixes shape and dtype, every other must match."""
    found: dict[str, TensorInfo] = {}
    for key, name in inputs:
        info = _lookup(models[key], name)
        if info is None:
            raise IncompatibleCheckpoints(f"tensor {name!r} is missing from {key}",
                                          tensor=name, models=[key])
        first = found.get(inputs[0][0], info)
        _check_input(first, inputs[0][0], info, key, name)
        found[key] = info
    first = found[inputs[0][0]]
    return PlannedTensor(out_name, first.shape, first.dtype, found)


def _call(
    sl: Slice, index: int, base: str | None, frac: float, names: list[str]
) -> SliceCall:
    """The call for one tensor of slice ``index``; ``names[j]`` is the tensor read from
    source ``j``."""
    base_at = [j for j, s in enumerate(sl.sources) if s.model == base]
    slots = tuple(j for j in range(len(sl.sources)) if j not in base_at)
    return SliceCall(
        index, base if base_at else None, tuple(sl.sources[j].model for j in slots), slots,
        frac, tuple(names[j] for j in base_at + list(slots)),
    )


def _end_tensors(
    names: list[str], sl: Slice, at: int, base: str | None,
    models: Mapping[str, ModelFolder],
) -> list[tuple[PlannedTensor, SliceCall]]:
    """Non-block tensors, merged from the sources of ``sl`` (slice ``at``; gradients at
    0)."""
    return [(_gather(n, [(s.model, n) for s in sl.sources], models),
             _call(sl, at, base, 0.0, [n] * len(sl.sources))) for n in names]


def _block_tensors(
    slices: list[tuple[int, Slice]], base: str | None, stacks: Mapping[str, _Stack],
    prefix: str, models: Mapping[str, ModelFolder],
) -> tuple[list[tuple[PlannedTensor, SliceCall]], list[tuple[str, int]]]:
    """Every slice's blocks, renumbered from 0; also (model, layer) of each output layer.
    ``slices``: (index in the plan, slice).

    Block ``k`` of a slice is merged from block ``start + k`` of each source, with
    gradients at depth ``k / (length - 1)`` inside the slice (1 for a one-block slice).
    """
    out: list[tuple[PlannedTensor, SliceCall]] = []
    origin: list[tuple[str, int]] = []
    for i, sl in slices:
        for k in range(sl.length):
            frac = k / (sl.length - 1) if sl.length > 1 else 1.0
            first = sl.sources[0]
            for suffix in stacks[first.model].blocks[first.layer_range[0] + k]:
                names = [f"{stacks[s.model].prefix}{s.layer_range[0] + k}{suffix}"
                         for s in sl.sources]
                planned = _gather(f"{prefix}{len(origin)}{suffix}",
                                  list(zip([s.model for s in sl.sources], names,
                                           strict=True)), models)
                out.append((planned, _call(sl, i, base, frac, names)))
            origin.append((first.model, first.layer_range[0] + k))
    return out, origin


@dataclass(frozen=True)
class _Group:
    """One stack of output layers: the whole model, or one module of a modules recipe."""

    module: ModuleLayout | None
    slices: list[tuple[int, str, Slice]]  # (index in the plan, where, slice)
    stacks: dict[str, _Stack]


def build_slice_plan(recipe: Recipe, models: Mapping[str, ModelFolder]) -> SlicePlan:
    """Plan a slices or modules recipe from headers: per stack (the model's, or each
    module's), non-block tensors below the blocks from the first slice's sources, each
    slice's blocks renumbered consecutively, the rest from the last slice's sources
    (mergekit's layout). A modules recipe writes the modules it names, in its order;
    a module given as models is one slice over all of the module's layers. ``models``
    holds every reference.

    RecipeError when a ``layer_range`` runs past a source's layers, or a module is not
    one the architecture has.
    """
    assert recipe.layered
    laid = recipe.laid_slices()
    keys = _distinct(recipe)
    # The layer count may differ between sources, and the vocabulary (each vocabulary
    # tensor is taken from one model's rows, as in mergekit); everything else must agree.
    check_configs({k: models[k] for k in keys},
                  tuple(f for f in ARCH_FIELDS if f not in (*LAYER_COUNT_KEYS, "vocab_size")))
    base = recipe.base_model if get_method(recipe.merge_method).uses_base else None
    # Config, tokenizer and the non-block tensor list follow base_model, else the first
    # source (mergekit's output config does the same).
    reference = recipe.base_model or laid[0].sources[0][0]
    groups = (_module_groups(recipe, models, reference) if recipe.modules is not None
              else [_whole_group(recipe, models)])
    pairs: list[tuple[PlannedTensor, SliceCall]] = []
    updates: dict[str, Any] = {}
    for g in groups:
        _check_ranges([(w, sl) for _, w, sl in g.slices], g.stacks)
        (_, _, first), (last_i, _, last) = g.slices[0], g.slices[-1]
        first_stack = g.stacks[first.sources[0].model]
        other = g.stacks.get(reference, first_stack).other
        below_marks = g.module.below if g.module is not None else _BELOW_BLOCKS
        below = [n for n in other if any(w in n for w in below_marks)]
        blocks, origin = _block_tensors([(i, sl) for i, _, sl in g.slices], base, g.stacks,
                                        first_stack.prefix, models)
        pairs += (_end_tensors(below, first, g.slices[0][0], base, models) + blocks
                  + _end_tensors([n for n in other if n not in below], last, last_i, base,
                                 models))
        types = [(models[m].config.get("layer_types") or [None] * (n + 1))[n]
                 for m, n in origin]
        if g.module is None:
            updates = _config_updates(models[reference].config, types)
        elif g.module.layers_key is not None:
            updates.update(_nested_count(models[reference].config, updates,
                                         g.module.layers_key, len(origin)))
    pairs = _aligned_rows(pairs, reference, models)
    notes = tuple(
        f"{t.name}: rows laid out in {reference}'s vocabulary of {t.shape[0]} tokens (its "
        f"source has {', '.join(str(i.shape[0]) for i in t.sources.values())} rows; "
        "mergekit 0.1.5 copies them as they are, which transformers cannot load)"
        for t, c in pairs if c.rows is not None)
    used, planned_tensors = {k: models[k] for k in keys}, [t for t, _ in pairs]
    plan = MergePlan(used, reference, planned_tensors, updates,
                     _slices_left_out(groups, used, reference, planned_tensors), notes)
    planned = sorted((i, sl) for g in groups for i, _, sl in g.slices)
    scopes = {i: dict(ls.module_parameters) for i, ls in enumerate(laid)}
    return SlicePlan(plan, [c for _, c in pairs], [sl for _, sl in planned],
                     [scopes[i] for i, _ in planned])


def _slices_left_out(groups: list[_Group], models: Mapping[str, ModelFolder], reference: str,
                     planned: list[PlannedTensor]) -> dict[str, dict[str, str]]:
    """The tensors of ``models`` a slices or modules recipe leaves out, with why; a
    tensor that no rule below explains is not listed (the accounting then refuses it)."""
    used = {(key, info.name) for t in planned for key, info in t.sources.items()}
    layouts = (module_layouts(models[reference].config)
               if any(g.module is not None for g in groups) else None)
    by_module = {g.module.name if g.module is not None else None: g for g in groups}
    tied = models[reference].tie_word_embeddings
    out: dict[str, dict[str, str]] = {}
    for key, folder in models.items():
        for name in folder.tensors:
            if (key, name) in used:
                continue
            if name == LM_HEAD and tied:
                reason: str | None = TIED_LM_HEAD
            elif layouts is not None and (module := module_of(name, layouts)) not in by_module:
                reason = f"not in the modules selected (module {module or 'none'})"
            else:
                group = by_module[module_of(name, layouts) if layouts is not None else None]
                reason = _slice_reason(key, name, group)
            if reason is not None:
                out.setdefault(key, {})[name] = reason
    return out


def _slice_reason(key: str, name: str, g: _Group) -> str | None:
    """Why the slices of ``g`` read no ``name`` of ``key``: a layer no ``layer_range``
    of ``key`` covers, or a tensor outside the layers taken from the first (below the
    layers) or last slice's sources when ``key`` is not one of them. None: they should
    have read it."""
    stack = g.stacks.get(key)
    if stack is None:
        return "outside the slices: no slice takes layers from this model"
    layer = _layer_of(name, stack, g.module)
    if layer is not None:
        covered = any(s.model == key and s.layer_range[0] <= layer < s.layer_range[1]
                      for _, _, sl in g.slices for s in sl.sources)
        return None if covered else f"outside the slices: layer {layer} is in no layer_range"
    marks = g.module.below if g.module is not None else _BELOW_BLOCKS
    below = any(w in name for w in marks)
    end = g.slices[0][2] if below else g.slices[-1][2]
    if any(s.model == key for s in end.sources):
        return None
    return ("outside the slices: tensors outside the layers come from the "
            f"{'first' if below else 'last'} slice's sources")


def _layer_of(name: str, stack: _Stack, module: ModuleLayout | None) -> int | None:
    """The block index of ``name`` in ``stack`` (None: not a block tensor)."""
    if module is None:
        m = _BLOCK.match(name)
        return int(m.group(2)) if m is not None and m.group(1) == stack.prefix else None
    if module.block is None or not name.startswith(module.block):
        return None
    index, dot, _ = name[len(module.block):].partition(".")
    return int(index) if index.isdigit() and dot else None


def _aligned_rows(pairs: list[tuple[PlannedTensor, SliceCall]], reference: str,
                  models: Mapping[str, ModelFolder]
                  ) -> list[tuple[PlannedTensor, SliceCall]]:
    """Vocabulary tensors (embedding, LM head) of a slices recipe over checkpoints whose
    vocabularies differ (by added tokens, typically), laid out in the output's.

    mergekit copies each such tensor whole from its slice's model: the embedding from
    the first slice's, the head from the last one's. With vocabularies of different
    sizes its output holds, say, a 64-row embedding and a 66-row head under a config of
    64 tokens, which transformers refuses to load. Here the rows are the same ones,
    matched by token into the vocabulary the output carries (the reference's tokenizer
    and config): every row both have is mergekit's; a token the reference lacks is
    dropped, one the source lacks is zeros (mergekit's row for a token no merged model
    has). Merging vocabulary tensors of different sizes is refused (by the shape check
    that gathers a tensor's sources), as mergekit refuses it."""
    out_rows = embedding_rows(models[reference])
    aligned = []
    for t, call in pairs:
        if not is_vocab_tensor(t.name) or t.shape[0] == out_rows:
            aligned.append((t, call))
            continue
        rows = tuple(_row_map(models[reference], models[k], out_rows, t.sources[k].shape[0])
                     for k in call.keys)
        t = PlannedTensor(t.name, (out_rows, *t.shape[1:]), t.dtype, t.sources)
        aligned.append((t, dataclasses.replace(call, rows=rows)))
    return aligned


def _row_map(out: ModelFolder, src: ModelFolder, out_rows: int, src_rows: int
             ) -> tuple[int, ...]:
    """For each row of ``out``'s vocabulary, the row of ``src`` holding the same token
    (-1: ``src`` lacks it); by position where either has no tokenizer.json to match by,
    and for rows past ``out``'s tokens (padding)."""
    mine, theirs = read_vocab(out, label="reference"), read_vocab(src, label="source")
    by_pos = tuple(i if i < src_rows else -1 for i in range(out_rows))
    if mine is None or theirs is None:
        return by_pos
    rows = list(by_pos)
    for token, i in mine.ids.items():
        if i < out_rows:
            j = theirs.ids.get(token, -1)
            rows[i] = j if 0 <= j < src_rows else -1
    return tuple(rows)


def _whole_group(recipe: Recipe, models: Mapping[str, ModelFolder]) -> _Group:
    assert recipe.slices is not None
    used = {s.model for sl in recipe.slices for s in sl.sources}
    return _Group(None, [(i, f"slices[{i}]", sl) for i, sl in enumerate(recipe.slices)],
                  {k: _stack(k, models[k]) for k in _distinct(recipe) if k in used})


def _module_groups(recipe: Recipe, models: Mapping[str, ModelFolder], reference: str
                   ) -> list[_Group]:
    """Each module the recipe names, with its stacks; a module given as models becomes
    one slice over every layer of the module (the same count in every model)."""
    assert recipe.modules is not None
    layouts = module_layouts(models[reference].config)
    if layouts is None and set(recipe.modules) == {DEFAULT_MODULE}:
        return [_default_module(recipe, models)]
    if layouts is None:
        kind = models[reference].config.get("model_type") or "unknown"
        raise RecipeError(
            f"modules: {reference} ({kind}) is not a multi-module architecture this "
            f"engine knows ({', '.join(sorted(MODULAR))}); its one module is "
            f"{DEFAULT_MODULE!r}, or lay out its layers with slices",
            key="modules", model_type=kind)
    groups: dict[str, _Group] = {}
    for i, laid in enumerate(recipe.laid_slices()):
        assert laid.module is not None
        layout = layouts.get(laid.module)
        if layout is None:
            raise RecipeError(
                f"modules: {laid.module!r} is not a module of "
                f"{models[reference].config.get('model_type')} ({', '.join(layouts)})",
                key=f"modules.{laid.module}", modules=list(layouts))
        g = groups.setdefault(laid.module, _Group(layout, [], {}))
        for m, _ in laid.sources:
            if m not in g.stacks:
                g.stacks[m] = _module_stack(m, models[m], layout, layouts)
        sl = laid.slice if laid.slice is not None else _whole_module(laid, g.stacks)
        g.slices.append((i, laid.where, sl))
    return list(groups.values())


# mergekit's name for the one module of a one-stack architecture (a plain Llama):
# ``modules: {default: ...}`` there is the same merge as top-level slices or models.
DEFAULT_MODULE = "default"


def _default_module(recipe: Recipe, models: Mapping[str, ModelFolder]) -> _Group:
    """``modules: {default: ...}`` on a one-stack model: the whole model as one stack
    (a module given as models is one slice over all its layers), planned as a slices
    recipe is; the module's parameters keep their place in the lookup."""
    laid = recipe.laid_slices()
    stacks = {k: _stack(k, models[k]) for k in _distinct(recipe)
              if any(k == m for ls in laid for m, _ in ls.sources)}
    return _Group(None, [(i, ls.where, ls.slice if ls.slice is not None
                          else _whole_module(ls, stacks))
                         for i, ls in enumerate(laid)], stacks)


def _whole_module(laid: LaidSlice, stacks: Mapping[str, _Stack]) -> Slice:
    """A module given as models: one slice over all of its layers."""
    counts = {m: len(stacks[m].blocks) for m, _ in laid.sources}
    if len(set(counts.values())) > 1:
        raise IncompatibleCheckpoints(
            f"{laid.where}: the models have different numbers of {laid.module} layers "
            f"({counts}); lay the module out with slices", module=laid.module,
            layers=counts)
    n = next(iter(counts.values()))
    # Built without validation: a module without blocks (a projector) has range [0, 0).
    return Slice.model_construct(sources=[
        SliceSource.model_construct(model=m, layer_range=(0, n), parameters=dict(p))
        for m, p in laid.sources], parameters={})


def _nested_count(config: Mapping[str, Any], updates: Mapping[str, Any], key: str,
                  layers: int) -> dict[str, Any]:
    """The config update that sets the dotted ``key`` (e.g. ``vision_config.depth``) to
    ``layers``, on top of ``updates`` already made to the same sub-config."""
    head, _, leaf = key.rpartition(".")
    if not head:
        return {leaf: layers}
    sub = dict(updates.get(head) or config.get(head) or {})
    sub[leaf] = layers
    return {head: sub}


def _config_updates(config: Mapping[str, Any], layer_types: list[Any]) -> dict[str, Any]:
    """The output config's layer count (and per-layer types, where the config lists
    them: ``layer_types[j]`` is output layer j's source layer's type)."""
    layers = len(layer_types)
    updates: dict[str, Any] = {}
    key = layer_count_key(config)
    if key is not None or "text_config" not in config:
        updates[key or "num_hidden_layers"] = layers
    else:
        text = config["text_config"]
        updates["text_config"] = {**text,
                                  layer_count_key(text) or "num_hidden_layers": layers}
    if isinstance(config.get("layer_types"), list) and None not in layer_types:
        updates["layer_types"] = layer_types
    return updates
