"""Resolve recipe parameter values for one tensor (conditions and layer gradients)."""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from maec_core.errors import RecipeError
from maec_core.recipe.values import Condition, ParamValue, Scalar

# A transformer block's tensor: "<stack>.<i>.<rest>", the stack "<...>.layers" (Llama
# and most others) or "<...>.h" (GPT-2, Falcon, BLOOM). Groups: stack with its dot,
# index, rest with its dot.
BLOCK_PATTERN = r"^(.*\.(?:layers|h)\.)(\d+)(\..+)$"
_LAYER = re.compile(r"\.(?:layers|h)\.(\d+)\.")


def layer_index(name: str) -> int | None:
    """The transformer block index in a tensor name (``model.layers.7.mlp...`` -> 7)."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def layer_fraction(name: str, num_layers: int) -> float:
    """Position of a tensor in depth, 0..1, for gradients.

    Layer i of N sits at i/(N-1) (a single layer at 1). Tensors outside the blocks
    (embedding, final norm, lm_head) sit at 0: mergekit 0.1.5 resolves them with t = 0,
    and a gradient recipe must give the same tensors here as there.
    """
    idx = layer_index(name)
    if idx is None:
        return 0.0
    return idx / (num_layers - 1) if num_layers > 1 else 1.0


def _gradient(values: list[float], frac: float) -> float:
    if len(values) == 1:
        return float(values[0])
    pos = frac * (len(values) - 1)
    lo = min(int(pos), len(values) - 2)
    w = pos - lo
    return float(values[lo]) * (1 - w) + float(values[lo + 1]) * w


def resolve_value(value: ParamValue, name: str, num_layers: int) -> Scalar | None:
    """The scalar a parameter takes for tensor ``name``; None when no condition matches."""
    return resolve_value_at(value, name, layer_fraction(name, num_layers))


def resolve_value_at(value: ParamValue, name: str, frac: float) -> Scalar | None:
    """As :func:`resolve_value`, at depth ``frac`` (0..1) given by the caller: in a
    slices recipe a gradient runs over each slice, not over the whole model."""
    if isinstance(value, list):
        if value and all(isinstance(v, Condition) for v in value):
            for cond in value:
                assert isinstance(cond, Condition)
                # "*" is mergekit's explicit catch-all.
                if cond.filter is None or cond.filter == "*" or cond.filter in name:
                    return resolve_value_at(cond.value, name, frac)
            return None
        nums = [float(v) for v in value if not isinstance(v, Condition)]
        return _gradient(nums, frac)
    return value


def resolve_scopes(
    scopes: Sequence[Mapping[str, ParamValue]], keys: Collection[str], name: str, frac: float
) -> dict[str, Scalar]:
    """Each of ``keys`` from the first scope (most specific first) that gives it a value
    for tensor ``name``: a scope whose conditions all miss falls through to the next, as
    in mergekit's slice, then recipe, parameter lookup."""
    out: dict[str, Scalar] = {}
    for key in keys:
        for scope in scopes:
            if key in scope:
                v = resolve_value_at(scope[key], name, frac)
                if v is not None:
                    out[key] = v
                    break
    return out


def resolve_params(
    params: Mapping[str, ParamValue], name: str, num_layers: int
) -> dict[str, Scalar]:
    out: dict[str, Scalar] = {}
    for key, value in params.items():
        v = resolve_value(value, name, num_layers)
        if v is not None:
            out[key] = v
    return out


def validated_params(model: type[BaseModel], params: Mapping[str, ParamValue], name: str,
                     num_layers: int) -> Any:
    """``params`` resolved for tensor ``name`` and validated by ``model`` (the engine's
    per-tensor parameters; the API runs the same over the planned tensors first)."""
    return validate_resolved(model, resolve_params(params, name, num_layers), name)


def validate_resolved(model: type[BaseModel], resolved: Mapping[str, Scalar], name: str
                      ) -> Any:
    """Parameters resolved for tensor ``name``, validated by ``model`` (RecipeError)."""
    try:
        return model.model_validate(resolved)
    except ValidationError as exc:
        # A condition that leaves a required value unset for this tensor, or a gradient
        # point a field refuses: the recipe's fault, named as such.
        problems = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        raise RecipeError(f"parameters for tensor {name!r} resolve to {dict(resolved)}: "
                          + "; ".join(problems), tensor=name, problems=problems) from None


def candidate_values(value: ParamValue) -> list[Scalar]:
    """Every scalar a parameter can take, to validate ranges before running."""
    if isinstance(value, list):
        out: list[Scalar] = []
        for v in value:
            out.extend(candidate_values(v.value) if isinstance(v, Condition) else [v])
        return out
    return [value]
