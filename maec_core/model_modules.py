"""The modules of multi-module checkpoints (vision-language models), by ``model_type``.

A recipe's ``modules:`` (mergekit's shape for these architectures) lays out each module
on its own: the language model's blocks as slices, the vision tower's and projector's
merged whole, for instance. Each module is known by the tensor names it owns, the name
of its block stack, where its config keeps its layer count, and which of its other
tensors sit below its blocks (embeddings: merged from a module's first slice, the rest
from its last, as for a plain slices recipe).

The names are those the checkpoints carry on disk (``save_pretrained``'s layout, which
for these architectures is also the layout mergekit 0.1.5 reads). A tensor belongs to
the module with the longest matching name prefix, so a projector inside the vision
tower's namespace (Qwen2-VL's ``visual.merger.``) is told apart from the tower.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModuleLayout:
    name: str
    prefixes: tuple[str, ...]  # the tensor-name prefixes the module owns
    block: str | None  # its blocks are "<block><i>.<rest>"; None: no blocks
    layers_key: str | None  # dotted config key of its layer count
    below: tuple[str, ...] = ()  # substrings of its non-block tensors below the blocks


def _text(prefixes: tuple[str, ...], block: str, layers_key: str) -> ModuleLayout:
    return ModuleLayout("text_decoder", prefixes, block, layers_key, ("embed_tokens",))


def _vision(prefix: str, block: str, layers_key: str, below: tuple[str, ...]
            ) -> ModuleLayout:
    return ModuleLayout("vision_tower", (prefix,), block, layers_key, below)


def _vlm(text: ModuleLayout, projector: tuple[str, ...], vision: ModuleLayout
         ) -> dict[str, ModuleLayout]:
    """A VLM's three modules: the language model, the projector (no blocks), the tower."""
    return {"text_decoder": text,
            "multi_modal_projector": ModuleLayout("multi_modal_projector", projector, None,
                                                  None),
            "vision_tower": vision}


def _llava_style(vision: ModuleLayout) -> dict[str, ModuleLayout]:
    """Llava's layout: ``language_model.``, ``multi_modal_projector.``, a vision tower."""
    return _vlm(_text(("language_model.",), "language_model.model.layers.",
                      "text_config.num_hidden_layers"), ("multi_modal_projector.",), vision)


def _qwen2_vl(text_layers: str) -> dict[str, ModuleLayout]:
    """Qwen2-VL's layout: the language model at the top level, ``visual.`` beside it."""
    return _vlm(_text(("model.", "lm_head."), "model.layers.", text_layers),
                ("visual.merger.",),
                _vision("visual.", "visual.blocks.", "vision_config.depth", ("patch_embed",)))


MODULAR: dict[str, dict[str, ModuleLayout]] = {
    "mistral3": _llava_style(_vision("vision_tower.", "vision_tower.transformer.layers.",
                                     "vision_config.num_hidden_layers",
                                     ("patch_conv", "ln_pre"))),
    "gemma3": _llava_style(_vision("vision_tower.vision_model.",
                                   "vision_tower.vision_model.encoder.layers.",
                                   "vision_config.num_hidden_layers", ("embeddings",))),
    "qwen2_vl": _qwen2_vl("num_hidden_layers"),
    "qwen2_5_vl": _qwen2_vl("text_config.num_hidden_layers"),
    "qwen3_vl": _vlm(_text(("model.language_model.", "lm_head."),
                           "model.language_model.layers.", "text_config.num_hidden_layers"),
                     ("model.visual.merger.", "model.visual.deepstack_merger_list."),
                     _vision("model.visual.", "model.visual.blocks.", "vision_config.depth",
                             ("patch_embed", "pos_embed"))),
}


def module_layouts(config: Mapping[str, Any]) -> dict[str, ModuleLayout] | None:
    """The modules of a checkpoint with this config, or None for a one-stack model."""
    return MODULAR.get(str(config.get("model_type") or ""))


def module_of(name: str, layouts: Mapping[str, ModuleLayout]) -> str | None:
    """The module that owns tensor ``name`` (the longest prefix wins), or None."""
    best, length = None, -1
    for layout in layouts.values():
        for prefix in layout.prefixes:
            if name.startswith(prefix) and len(prefix) > length:
                best, length = layout.name, len(prefix)
    return best
