"""Modules recipes (mergekit's shape for multi-module models such as VLMs): which tensors
belong to which module, the recipe's shape checks, the plan's per-module layout, the
parameter lookup order and the refusals. mergekit's own results on the same recipes are
compared in tests/conformance (arch_mistral3_*)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from maec_core.errors import IncompatibleCheckpoints, RecipeError
from maec_core.model_modules import MODULAR, module_of
from maec_core.parsing import parse_recipe
from tests.conformance.models import make_model
from tests.core.conftest import leftovers
from tests.factories import make_llama, read_config, run_recipe


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny Mistral3 VLMs (6 text layers, 2 vision blocks, a projector), the second
    a fine-tune of the first, and a Llama."""
    root = tmp_path_factory.mktemp("vlm")
    base = make_model(root / "base", "mistral3", seed=0)
    return {"base": base, "a": make_model(root / "a", "mistral3", seed=1, like=base),
            "llama": make_llama(root / "llama", seed=3)}


def modules(**mods: Any) -> dict[str, Any]:
    return {"merge_method": "passthrough", "modules": mods, "dtype": "float32"}


def whole(model: Path, **params: Any) -> dict[str, Any]:
    return {"models": [{"model": str(model), **({"parameters": params} if params else {})}]}


def test_every_tensor_has_the_module_mergekit_gives_it() -> None:
    qwen = MODULAR["qwen2_vl"]
    assert module_of("visual.merger.mlp.0.weight", qwen) == "multi_modal_projector"
    assert module_of("visual.blocks.3.attn.qkv.weight", qwen) == "vision_tower"
    assert module_of("lm_head.weight", qwen) == "text_decoder"
    assert module_of("model.layers.0.mlp.up_proj.weight", qwen) == "text_decoder"
    mistral3 = MODULAR["mistral3"]
    assert module_of("language_model.lm_head.weight", mistral3) == "text_decoder"
    assert module_of("something.else", mistral3) is None


@pytest.mark.parametrize(("recipe", "message"), [
    ({"merge_method": "linear", "modules": {}}, "modules is empty"),
    ({"merge_method": "linear", "models": [{"model": "x"}],
      "modules": {"text_decoder": {"models": [{"model": "x"}]}}},
     "one of models, slices or modules"),
    ({"merge_method": "linear", "modules": {"text_decoder": {}}}, "either slices or models"),
    ({"merge_method": "linear", "tokenizer_source": "union",
      "modules": {"text_decoder": {"models": [{"model": "x"}]}}}, "not a union vocabulary"),
    ({"merge_method": "maec", "modules": {"text_decoder": {"models": [{"model": "x"}]}}},
     "not modules"),
])
def test_bad_modules_recipes_name_the_problem(recipe: dict[str, Any], message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        parse_recipe(recipe)


def test_module_sources_are_listed_and_rewritten(vlm: dict[str, Path]) -> None:
    recipe = parse_recipe(modules(
        text_decoder={"slices": [{"sources": [{"model": "p", "layer_range": [0, 2]}]}]},
        vision_tower={"models": [{"model": "q"}]}))
    assert [(s.role, s.ref) for s in recipe.sources()] == [("slice_source", "p"),
                                                           ("slice_source", "q")]
    moved = recipe.with_sources({"p": "/m/p", "q": "/m/q"})
    assert [s.ref for s in moved.sources()] == ["/m/p", "/m/q"]


def test_a_vlm_frankenmerge_lays_out_each_module(vlm: dict[str, Path], tmp_path: Path
                                                 ) -> None:
    """The text decoder's blocks come from two runs (renumbered), the vision tower and
    the projector whole from the base; each config layer count follows its module."""
    out = tmp_path / "out"
    run_recipe(modules(
        text_decoder={"slices": [
            {"sources": [{"model": str(vlm["base"]), "layer_range": [0, 2]}]},
            {"sources": [{"model": str(vlm["a"]), "layer_range": [1, 6]}]}]},
        vision_tower=whole(vlm["base"]), multi_modal_projector=whole(vlm["base"])), out)
    got, base, a = (load_file(str(f / "model.safetensors")) for f in (out, vlm["base"], vlm["a"]))
    text = "language_model.model.layers."
    assert torch.equal(got[f"{text}1.mlp.up_proj.weight"], base[f"{text}1.mlp.up_proj.weight"])
    assert torch.equal(got[f"{text}2.mlp.up_proj.weight"], a[f"{text}1.mlp.up_proj.weight"])
    assert torch.equal(got[f"{text}6.mlp.up_proj.weight"], a[f"{text}5.mlp.up_proj.weight"])
    assert f"{text}7.mlp.up_proj.weight" not in got
    # Embeddings from the first slice's source, the final norm from the last slice's.
    assert torch.equal(got["language_model.model.embed_tokens.weight"],
                       base["language_model.model.embed_tokens.weight"])
    assert torch.equal(got["language_model.model.norm.weight"],
                       a["language_model.model.norm.weight"])
    vision = [k for k in base if k.startswith(("vision_tower.", "multi_modal_projector."))]
    assert vision and all(torch.equal(got[k], base[k]) for k in vision)
    config = read_config(out)
    assert config["text_config"]["num_hidden_layers"] == 7
    assert config["vision_config"]["num_hidden_layers"] == 2


def test_module_parameters_sit_between_the_slice_and_the_recipe(vlm: dict[str, Path],
                                                                tmp_path: Path) -> None:
    """linear weights: the source's own, else its module's, else the recipe's."""
    out = tmp_path / "out"
    b, a = str(vlm["base"]), str(vlm["a"])
    run_recipe({"merge_method": "linear", "dtype": "float32", "parameters": {"weight": 1.0},
                "modules": {
                    "text_decoder": {"models": [{"model": b, "parameters": {"weight": 3.0}},
                                                {"model": a}]},
                    "vision_tower": {"parameters": {"weight": 0.0},
                                     "models": [{"model": b}, {"model": a,
                                                               "parameters": {"weight": 1.0}}]},
                    "multi_modal_projector": {"models": [{"model": b}, {"model": a}]}}}, out)
    got, tb, ta = (load_file(str(f / "model.safetensors")) for f in (out, vlm["base"], vlm["a"]))
    name = "language_model.model.layers.0.mlp.up_proj.weight"
    torch.testing.assert_close(got[name], (3 * tb[name] + ta[name]) / 4)
    name = "vision_tower.transformer.layers.0.attention.q_proj.weight"
    torch.testing.assert_close(got[name], ta[name])  # base weighted 0 by its module
    name = "multi_modal_projector.linear_1.weight"
    torch.testing.assert_close(got[name], (tb[name] + ta[name]) / 2)


def test_refusals_name_the_module_and_leave_nothing(vlm: dict[str, Path], tmp_path: Path
                                                    ) -> None:
    out = tmp_path / "out"
    with pytest.raises(RecipeError, match="'audio_tower' is not a module of mistral3"):
        run_recipe(modules(audio_tower=whole(vlm["base"])), out)
    with pytest.raises(RecipeError, match="not a multi-module architecture"):
        run_recipe(modules(text_decoder=whole(vlm["llama"])), out)
    # mergekit's one module of a one-stack model is not a VLM's.
    with pytest.raises(RecipeError, match="'default' is not a module of mistral3"):
        run_recipe(modules(default=whole(vlm["base"])), out)
    with pytest.raises(RecipeError, match=r"modules.text_decoder.slices\[0\].sources\[0\]: "
                                          r"layer_range \[0, 9\] exceeds the 6 layers"):
        run_recipe(modules(text_decoder={"slices": [
            {"sources": [{"model": str(vlm["base"]), "layer_range": [0, 9]}]}]}), out)
    assert not out.exists() and not leftovers(out)


def test_a_module_merged_whole_needs_the_same_layer_count(vlm: dict[str, Path],
                                                          tmp_path: Path) -> None:
    deeper = make_model(tmp_path / "deeper", "mistral3", seed=5)
    # Drop the last text block: the same architecture with five layers.
    import json

    from safetensors.torch import save_file

    tensors = load_file(str(deeper / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if ".layers.5." not in k},
              str(deeper / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((deeper / "config.json").read_text())
    config["text_config"]["num_hidden_layers"] = 5
    (deeper / "config.json").write_text(json.dumps(config))
    with pytest.raises(IncompatibleCheckpoints, match="different numbers of text_decoder"):
        run_recipe({"merge_method": "linear", "modules": {"text_decoder": {"models": [
            {"model": str(vlm["base"]), "parameters": {"weight": 1.0}},
            {"model": str(deeper), "parameters": {"weight": 1.0}}]}}}, tmp_path / "out")


def test_a_parameter_no_method_reads_in_a_module_is_a_warning(vlm: dict[str, Path]) -> None:
    from maec_core.methods.registry import get_method

    recipe = parse_recipe(modules(vision_tower={"parameters": {"density": 0.5},
                                                **whole(vlm["base"])}))
    warned = get_method("passthrough").ignored(recipe)
    assert warned == ["modules.vision_tower.parameters.density ignored: merge_method "
                      "'passthrough' does not read it"]
