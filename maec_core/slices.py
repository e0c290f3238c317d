"""Running a slices recipe: what the streaming merge reads and computes per tensor.

The plan (``maec_core.plan.build_slice_plan``) says, per output tensor, which slice it
belongs to, which sources' tensors it reads and at what depth; this module turns that
into the ``read`` and ``compute`` the engine's ``stream_merge`` takes, resolving each
parameter in mergekit's order: the source's own, then its slice's, then the recipe's.
Torch is touched only through the method's tensor function and the row layout of a
vocabulary tensor (imported there), so importing this module does not import it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from maec_core.errors import RecipeError
from maec_core.io.folder import open_model_folder
from maec_core.io.headers import TensorInfo
from maec_core.methods.base import TensorCall, TensorMethod, field_keys
from maec_core.methods.params import layer_index, resolve_scopes, validate_resolved
from maec_core.plan import MergePlan, PlannedTensor, SliceCall, build_slice_plan, config_layers
from maec_core.recipe import Recipe, Slice

if TYPE_CHECKING:
    import torch

# Parameter sets kept per tensor name: element-wise merges ask once per 1 MB slice, and
# at most a few tensors are in flight at once.
log = logging.getLogger(__name__)
_CACHE = 8


@dataclass(frozen=True)
class SliceMerge:
    """Everything ``stream_merge`` needs for one slices recipe."""

    plan: MergePlan
    read: Callable[[PlannedTensor], list[TensorInfo]]
    compute: Callable[[PlannedTensor, list[torch.Tensor]], torch.Tensor]
    out_dtype: str
    tokenizer_from: str
    base_models: list[str]
    config_dtype: str | None = None  # what config.json names (None: out_dtype)
    # Tensors that go whole to ``compute`` in an element-wise merge: those whose rows
    # are laid out in the output vocabulary first.
    whole: Callable[[PlannedTensor], bool] | None = None


def prepare_slices(recipe: Recipe, spec: TensorMethod) -> SliceMerge:
    """Open every source (headers and configs only), plan, and build read/compute."""
    assert recipe.layered
    refs = list(dict.fromkeys(s.ref for s in recipe.sources() if s.kind == "checkpoint"))
    sliced = build_slice_plan(recipe, {
        ref: open_model_folder(ref, base=recipe.base_model, config_base=True) for ref in refs})
    plan = sliced.plan
    for note in plan.notes:
        log.warning("%s", note)
    calls = {t.name: c for t, c in zip(plan.tensors, sliced.calls, strict=True)}
    num_layers = config_layers(plan.config_updates) or plan.num_layers
    resolve = _resolver(recipe, spec, calls, sliced.slices, sliced.module_parameters)

    def read(t: PlannedTensor) -> list[TensorInfo]:
        return [t.sources[k] for k in calls[t.name].keys]

    def compute(t: PlannedTensor, inputs: list[torch.Tensor]) -> torch.Tensor:
        call = calls[t.name]
        model_params, params = resolve(t.name)
        if call.rows is not None:
            inputs = [_in_rows(x, rows) for x, rows in zip(inputs, call.rows, strict=True)]
        base = call.base is not None
        return spec.merge(TensorCall(
            name=t.name, base=inputs[0] if base else None,
            models=inputs[1:] if base else inputs, model_params=model_params,
            params=params, layer=layer_index(t.name), num_layers=num_layers,
        ))

    tokenizer_from = plan.reference
    if recipe.tokenizer_source and recipe.tokenizer_source != "base":
        if recipe.tokenizer_source not in plan.models:
            raise RecipeError(f"tokenizer_source {recipe.tokenizer_source!r} is not one of "
                              "the recipe's models", key="tokenizer_source")
        tokenizer_from = recipe.tokenizer_source
    return SliceMerge(plan, read, compute, spec.saved_dtype(recipe, plan.input_dtype),
                      tokenizer_from, list(plan.models),
                      recipe.output_dtype or plan.input_dtype,
                      whole=lambda t: calls[t.name].rows is not None)


def _in_rows(x: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor:
    """``x``'s rows in the order ``rows`` gives, zeros where it gives -1."""
    import torch

    at = torch.tensor(rows, dtype=torch.long, device=x.device)
    out = x.index_select(0, at.clamp(min=0))
    out[at < 0] = 0
    return out


def _resolver(
    recipe: Recipe, spec: TensorMethod, calls: dict[str, SliceCall], slices: list[Slice],
    modules: list[Mapping[str, Any]],
) -> Callable[[str], tuple[list[Any], Any]]:
    """Per tensor name: (each model's parameters, the method's), resolved once, in
    mergekit's order: the source's, its slice's, its module's, the recipe's.

    Locked: element-wise slices of two tensors may be computed on two threads at once.
    """
    shared, own = field_keys(spec.params), field_keys(spec.model_params)
    cache: dict[str, tuple[list[Any], Any]] = {}
    lock = threading.Lock()

    def resolve(name: str) -> tuple[list[Any], Any]:
        with lock:
            if name in cache:
                return cache[name]
            call = calls[name]
            sl, module = slices[call.slice], modules[call.slice]
            offset = 1 if call.base is not None else 0
            model_params = [
                validate_resolved(spec.model_params, resolve_scopes(
                    [sl.sources[slot].parameters, sl.parameters, module, recipe.parameters],
                    own, call.names[offset + i], call.frac), call.names[offset + i])
                for i, slot in enumerate(call.slots)
            ]
            params = validate_resolved(spec.params, resolve_scopes(
                [sl.parameters, module, recipe.parameters], shared, name, call.frac), name)
            if len(cache) >= _CACHE:
                cache.clear()
            cache[name] = (model_params, params)
            return cache[name]

    return resolve
