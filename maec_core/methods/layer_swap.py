"""Layer swapping (Bandarkar et al. 2024, arXiv:2410.01335).

Start from the ability expert (their "math expert"); replace its bottom ``bottom_k`` and
top ``top_k`` transformer blocks with the language expert's; optionally soften each seam
with a transition zone of ``transition`` blocks, the weighted averages sliding linearly
from the language expert (next to the swapped block) to the ability expert.

Tensors outside the blocks: the paper swaps transformer layers and is not explicit about
the embedding, final norm and lm_head, so the choice is a parameter. The default,
``non_layer: position``, treats the embedding as sitting below block 0 and the final norm
and lm_head above the last block (the same depth convention the layer gradients use):
they come from the language expert exactly when that end of the stack is swapped. The
token embedding is where a language's vocabulary lives, which is why the language expert's
bottom is worth taking with it. ``ability`` or ``language`` take all of them from one expert.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from maec_core.errors import RecipeError
from maec_core.methods.base import NamedForm, Params, TensorCall, TensorMethod

if TYPE_CHECKING:
    import torch

    from maec_core.recipe import Recipe


class LayerSwapModelParams(Params):
    role: Literal["ability", "language"]


class LayerSwapParams(Params):
    bottom_k: int = Field(1, ge=0)
    top_k: int = Field(1, ge=0)
    transition: int = Field(0, ge=0)
    # Where tensors outside the transformer blocks come from. "position" (default): the
    # embedding travels with the bottom block and the final norm and lm_head with the top
    # block, so they come from the language expert exactly when that end is swapped
    # (bottom_k > 0, top_k > 0). "ability" or "language" take them all from one expert.
    non_layer: Literal["position", "ability", "language"] = "position"


def language_weight(
    layer: int | None,
    name: str,
    num_layers: int,
    *,
    bottom_k: int,
    top_k: int,
    transition: int,
    non_layer: str = "position",
) -> float:
    """Share of the language expert in tensor ``name`` (0 = ability expert only)."""
    if layer is None:
        if non_layer == "ability":
            return 0.0
        if non_layer == "language":
            return 1.0
        at_bottom = "embed" in name
        return 1.0 if (bottom_k if at_bottom else top_k) > 0 else 0.0
    if bottom_k + top_k > num_layers:
        raise RecipeError(
            f"layer_swap: bottom_k + top_k = {bottom_k + top_k} exceeds the model's "
            f"{num_layers} layers",
            bottom_k=bottom_k, top_k=top_k, num_layers=num_layers,
        )
    w = transition
    alpha = 0.0
    if layer < bottom_k:
        return 1.0
    if bottom_k > 0 and layer < bottom_k + w:
        j = layer - bottom_k  # 0 next to the swapped block
        alpha = max(alpha, (w - j) / (w + 1))
    top_start = num_layers - top_k
    if layer >= top_start:
        return 1.0
    if top_k > 0 and layer >= top_start - w:
        j = top_start - 1 - layer
        alpha = max(alpha, (w - j) / (w + 1))
    return alpha


class LayerSwap(TensorMethod):
    name = "layer_swap"
    paper = ("Bandarkar et al. 2024, Layer swapping for zero-shot cross-lingual transfer "
             "(arXiv:2410.01335)")
    params = LayerSwapParams
    model_params = LayerSwapModelParams
    needs_base = False
    min_models = 2
    max_models = 2
    elementwise = True

    def validate(self, recipe: Recipe) -> None:
        super().validate(recipe)
        roles = sorted(str(m.parameters.get("role")) for m in recipe.models)
        if roles != ["ability", "language"]:
            raise RecipeError("layer_swap needs one model with role: ability and one with "
                              "role: language")

    def per_model_keys(self) -> set[str]:
        # The named form assigns the roles itself: the donor is the ability expert.
        return super().per_model_keys() - {"role"}

    def named_form(self, form: NamedForm) -> dict[str, Any]:
        if len(form.ability_donor) != 1:
            raise RecipeError("layer_swap takes exactly one ability donor")
        data = super().named_form(form)
        data["models"][0]["parameters"]["role"] = "ability"
        data["models"][1]["parameters"]["role"] = "language"
        return data

    def merge(self, call: TensorCall) -> torch.Tensor:
        """The ability expert with the language expert's bottom and top blocks swapped in."""
        roles = {p.role: t for t, p in zip(call.models, call.model_params, strict=True)}
        ability, language = roles["ability"], roles["language"]
        p = call.params
        alpha = language_weight(
            call.layer, call.name, call.num_layers, bottom_k=p.bottom_k, top_k=p.top_k,
            transition=p.transition, non_layer=p.non_layer,
        )
        # Whole blocks are copied exactly (no arithmetic), so swapped layers are
        # bit-identical to the expert they came from.
        if alpha == 0.0:
            return ability
        if alpha == 1.0:
            return language
        return ability.lerp(language, alpha)
