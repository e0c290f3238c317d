"""Passthrough: copy one source's tensors unchanged (mergekit's ``passthrough``).

With ``slices`` this stacks runs of layers taken from one model each, the "frankenmerge":
slices may repeat or drop layers, so the output may have more or fewer layers than any
input. The optional per-model ``scale`` multiplies the copied tensors (mergekit's knob
for damping repeated layers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from maec_core.errors import RecipeError
from maec_core.methods.base import NoParams, Params, TensorCall, TensorMethod

if TYPE_CHECKING:
    import torch

    from maec_core.recipe import Recipe


class PassthroughModelParams(Params):
    scale: float | None = None


class Passthrough(TensorMethod):
    name = "passthrough"
    paper = "Goddard et al. 2024, Arcee's MergeKit (arXiv:2403.13257), passthrough"
    params = NoParams
    model_params = PassthroughModelParams
    needs_base = False
    uses_base = False
    min_models = 1
    max_models = 1
    elementwise = True

    def validate(self, recipe: Recipe) -> None:
        # With models, base_model would be read and never used (with slices it only
        # names where tokenizer_source: base points, as in mergekit).
        if not recipe.layered and recipe.base_model is not None:
            raise RecipeError("merge_method 'passthrough' copies its one model; "
                              "leave out base_model or use slices")
        super().validate(recipe)

    def merge(self, call: TensorCall) -> torch.Tensor:
        """The single source's tensor, times ``scale`` when given."""
        (tensor,) = call.models
        scale = call.model_params[0].scale
        return tensor if scale is None else tensor.mul_(scale)
