"""Resolve recipe parameter values for one tensor (conditions and layer gradients)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from maec_core.errors import RecipeError
from maec_core.recipe import Condition, ParamValue, Scalar

_LAYER = re.compile(r"\.layers\.(\d+)\.")


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
    if isinstance(value, list):
        if value and all(isinstance(v, Condition) for v in value):
            for cond in value:
                assert isinstance(cond, Condition)
                # "*" is mergekit's explicit catch-all.
                if cond.filter is None or cond.filter == "*" or cond.filter in name:
                    return resolve_value(cond.value, name, num_layers)
            return None
        nums = [float(v) for v in value if not isinstance(v, Condition)]
        return _gradient(nums, layer_fraction(name, num_layers))
    return value


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
    resolved = resolve_params(params, name, num_layers)
    try:
        return model.model_validate(resolved)
    except ValidationError as exc:
        # A condition that leaves a required value unset for this tensor, or a gradient
        # point a field refuses: the recipe's fault, named as such.
        problems = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        raise RecipeError(f"parameters for tensor {name!r} resolve to {resolved}: "
                          + "; ".join(problems), tensor=name, problems=problems) from None


def candidate_values(value: ParamValue) -> list[Scalar]:
    """Every scalar a parameter can take, to validate ranges before running."""
    if isinstance(value, list):
        out: list[Scalar] = []
        for v in value:
            out.extend(candidate_values(v.value) if isinstance(v, Condition) else [v])
        return out
    return [value]
