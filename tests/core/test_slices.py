"""Slices recipes: shape checks, source listing, the header-only plan, passthrough runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from maec_core.errors import IncompatibleCheckpoints, RecipeError
from maec_core.io.folder import open_model_folder
from maec_core.parsing import parse_recipe
from maec_core.plan import build_slice_plan, plan_recipe
from tests.core.conftest import leftovers
from tests.factories import make_llama, read_config, run_recipe


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A four-layer base and a fine-tune of it, and a two-layer model of the same width."""
    root = tmp_path_factory.mktemp("deep")
    base = make_llama(root / "base", seed=0, num_hidden_layers=4)
    return {"base": base, "a": make_llama(root / "a", seed=1, like=base, num_hidden_layers=4),
            "short": make_llama(root / "short", seed=2, num_hidden_layers=2)}


def src(model: str | Path, lo: int, hi: int, **params: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"model": str(model), "layer_range": [lo, hi]}
    if params:
        out["parameters"] = params
    return out


def passthrough(*sources: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"merge_method": "passthrough", "slices": [{"sources": [s]} for s in sources],
            **extra}


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


# --- recipe shape (torch-free, no checkpoints) ---------------------------------------


@pytest.mark.parametrize(("recipe", "message"), [
    ({"merge_method": "passthrough", "slices": []}, "slices is empty"),
    ({"merge_method": "linear", "models": [{"model": "x"}],
      "slices": [{"sources": [src("x", 0, 1)]}]}, "either models or slices"),
    ({"merge_method": "linear", "slices": [{"sources": [src("x", 0, 2), src("y", 0, 3)]}]},
     "same number of layers"),
    ({"merge_method": "linear", "slices": [{"sources": [src("x", 0, 2), src("x", 2, 4)]}]},
     "names 'x' twice"),
    ({"merge_method": "passthrough", "slices": [{"sources": [src("x", 2, 2)]}]},
     "0 <= start < end"),
    ({"merge_method": "passthrough", "slices": [{"sources": [src("x", 0, 2), src("y", 0, 2)]}]},
     "exactly 1 model(s) in slices[0], got 2"),
    ({"merge_method": "ties", "base_model": "b",
      "slices": [{"sources": [src("b", 0, 2), src("x", 0, 2)]},
                 {"sources": [src("x", 2, 4)]}]},
     "needs base_model 'b' among the sources of slices[1]"),
    ({"merge_method": "ties", "base_model": "b",
      "slices": [{"sources": [src("b", 0, 2), src("x", 0, 2, density=2.0)]}]},
     "slices[0].sources[1].parameters.density"),
    ({"merge_method": "passthrough", "base_model": "x", "models": [{"model": "x"}]},
     "leave out base_model"),
    ({"merge_method": "maec", "language_base": "l", "abilities": [{"model": "d"}],
      "slices": [{"sources": [src("x", 0, 2)]}]}, "not slices"),
    ({"merge_method": "maec", "language_base": "l", "abilities": [{"model": "d"}],
      "out_dtype": "bfloat16"}, "not out_dtype"),
])
def test_bad_slices_recipes_name_the_problem(recipe: dict[str, Any], message: str) -> None:
    with pytest.raises(RecipeError) as info:
        parse_recipe(recipe)
    assert info.value.code == "invalid_recipe"
    assert message in info.value.message


def test_slice_sources_are_listed_and_rewritten() -> None:
    recipe = parse_recipe({
        "merge_method": "ties", "base_model": "b", "tokenizer_source": "x",
        "slices": [{"sources": [src("b", 0, 2), src("x", 0, 2, density=0.5)]},
                   {"sources": [src("b", 2, 4), src("y", 1, 3)],
                    "parameters": {"weight": 0.3}}],
    })
    assert [(s.role, s.ref, s.index, s.slot, s.kind) for s in recipe.sources()] == [
        ("base", "b", None, None, "checkpoint"),
        ("slice_source", "b", 0, 0, "checkpoint"),
        ("slice_source", "x", 0, 1, "checkpoint"),
        ("slice_source", "b", 1, 0, "checkpoint"),
        ("slice_source", "y", 1, 1, "checkpoint"),
        ("tokenizer", "x", None, None, "tokenizer"),
    ]
    moved = recipe.with_sources({"b": "/c/b", "x": "/c/x", "y": "/c/y"})
    assert [s.ref for s in moved.sources()] == ["/c/b", "/c/b", "/c/x", "/c/b", "/c/y",
                                                "/c/x"]
    assert moved.slices is not None and moved.slices[0].sources[1].parameters == {
        "density": 0.5}
    # The YAML written beside outputs parses back to the same recipe.
    assert parse_recipe(moved.to_yaml()) == moved


# --- the plan (headers only) ----------------------------------------------------------


def folders_for(recipe: dict[str, Any]) -> dict[str, Any]:
    parsed = parse_recipe(recipe)
    refs = dict.fromkeys(s.ref for s in parsed.sources() if s.kind == "checkpoint")
    return {r: open_model_folder(r) for r in refs}


def test_layer_range_past_a_models_layers_is_a_recipe_error(deep: dict[str, Path]) -> None:
    recipe = passthrough(src(deep["base"], 0, 4), src(deep["short"], 1, 3))
    with pytest.raises(RecipeError) as info:
        plan_recipe(parse_recipe(recipe), folders_for(recipe))
    assert info.value.code == "invalid_recipe"
    assert info.value.message.startswith("slices[1].sources[0]: layer_range [1, 3] exceeds "
                                         "the 2 layers of")
    assert info.value.details["layers"] == 2


def test_plan_renumbers_layers_and_takes_ends_from_first_and_last_slice(
    deep: dict[str, Path],
) -> None:
    base, a = str(deep["base"]), str(deep["a"])
    recipe = passthrough(src(base, 0, 3), src(a, 1, 4), src(deep["short"], 0, 2))
    sliced = build_slice_plan(parse_recipe(recipe), folders_for(recipe))
    plan = sliced.plan
    assert plan.config_updates == {"num_hidden_layers": 8}
    assert plan.reference == base
    by_name = dict(zip([t.name for t in plan.tensors], sliced.calls, strict=True))
    q = ".self_attn.q_proj.weight"
    # Output layer 4 is the second slice's second layer: a's layer 2.
    (info,) = next(t for t in plan.tensors if t.name == f"model.layers.4{q}").sources.values()
    assert (info.name, info.file.parent) == (f"model.layers.2{q}", deep["a"])
    assert by_name[f"model.layers.4{q}"].frac == 0.5
    assert by_name[f"model.layers.4{q}"].models == (a,)
    # Embedding from the first slice's model, final norm and lm_head from the last one's.
    assert by_name["model.embed_tokens.weight"].models == (base,)
    assert by_name["model.norm.weight"].models == (str(deep["short"]),)
    assert by_name["lm_head.weight"].models == (str(deep["short"]),)
    assert plan.tensors[0].name == "model.embed_tokens.weight"
    assert len({t.name for t in plan.tensors}) == len(plan.tensors) == 3 + 8 * 9


def test_plan_splits_base_from_the_other_sources(deep: dict[str, Path]) -> None:
    base, a = str(deep["base"]), str(deep["a"])
    recipe = {"merge_method": "task_arithmetic", "base_model": base,
              "slices": [{"sources": [src(a, 0, 4), src(base, 0, 4)]}]}
    sliced = build_slice_plan(parse_recipe(recipe), folders_for(recipe))
    assert {(c.base, c.models, c.slots) for c in sliced.calls} == {(base, (a,), (0,))}
    assert sliced.plan.config_updates == {"num_hidden_layers": 4}


def test_plan_rebuilds_per_layer_types(deep: dict[str, Path], tmp_path: Path) -> None:
    model = tmp_path / "typed"
    model.mkdir()
    for f in deep["base"].iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    cfg = read_config(model)
    cfg["layer_types"] = ["full_attention", "sliding_attention"] * 2
    (model / "config.json").write_text(json.dumps(cfg))
    recipe = passthrough(src(model, 1, 2), src(model, 0, 4))
    plan = build_slice_plan(parse_recipe(recipe), folders_for(recipe)).plan
    assert plan.config_updates["layer_types"] == [
        "sliding_attention", "full_attention", "sliding_attention", "full_attention",
        "sliding_attention"]


def test_sources_of_other_widths_are_incompatible(deep: dict[str, Path], tmp_path: Path
                                                  ) -> None:
    wide = make_llama(tmp_path / "wide", seed=3, num_hidden_layers=2, hidden_size=48,
                      num_attention_heads=6, num_key_value_heads=3, tokenizer=False)
    recipe = passthrough(src(deep["base"], 0, 2), src(wide, 0, 2))
    with pytest.raises(IncompatibleCheckpoints, match="hidden_size differs"):
        plan_recipe(parse_recipe(recipe), folders_for(recipe))


def test_plan_recipe_without_slices_is_build_plan(deep: dict[str, Path]) -> None:
    recipe = {"merge_method": "task_arithmetic", "base_model": str(deep["base"]),
              "models": [{"model": str(deep["a"])}]}
    plan = plan_recipe(parse_recipe(recipe), folders_for(recipe))
    assert plan.reference == str(deep["base"]) and plan.config_updates == {}
    assert len(plan.tensors) == 3 + 4 * 9


# --- running ---------------------------------------------------------------------------


def test_frankenmerge_copies_layers_exactly(deep: dict[str, Path], tmp_path: Path) -> None:
    base, a = deep["base"], deep["a"]
    out = tmp_path / "out"
    result = run_recipe(passthrough(src(base, 0, 3), src(a, 1, 4), src(base, 3, 4)), out)
    got, other, mine = tensors(out), tensors(a), tensors(base)
    cfg = read_config(out)
    assert cfg["num_hidden_layers"] == 7 and cfg["dtype"] == "float32"
    assert result.tensors == len(got) == 3 + 7 * 9
    layer_of = [(mine, 0), (mine, 1), (mine, 2), (other, 1), (other, 2), (other, 3),
                (mine, 3)]
    for j, (weights, i) in enumerate(layer_of):
        for suffix in (".mlp.down_proj.weight", ".input_layernorm.weight"):
            assert torch.equal(got[f"model.layers.{j}{suffix}"],
                               weights[f"model.layers.{i}{suffix}"])
    assert torch.equal(got["model.embed_tokens.weight"], mine["model.embed_tokens.weight"])
    assert torch.equal(got["lm_head.weight"], mine["lm_head.weight"])
    # The published folder loads as a 7-layer model.
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.config.num_hidden_layers == 7
    logits = loaded(torch.tensor([[1, 5, 9]])).logits
    assert bool(torch.isfinite(logits).all())


def test_passthrough_scale_and_out_dtype(deep: dict[str, Path], tmp_path: Path) -> None:
    a = deep["a"]
    out = tmp_path / "out"
    run_recipe(passthrough(src(a, 2, 4, scale=0.5), dtype="float32", out_dtype="bfloat16"),
               out)
    got, ref = tensors(out), tensors(a)
    assert read_config(out)["num_hidden_layers"] == 2
    assert read_config(out)["dtype"] == "bfloat16"
    name = "model.layers.0.self_attn.k_proj.weight"
    assert got[name].dtype == torch.bfloat16
    assert torch.equal(got[name], (ref["model.layers.2.self_attn.k_proj.weight"] * 0.5)
                       .to(torch.bfloat16))


def test_out_dtype_sets_the_saved_dtype_of_a_models_recipe(deep: dict[str, Path],
                                                           tmp_path: Path) -> None:
    recipe = {"merge_method": "linear", "dtype": "float32", "out_dtype": "float16",
              "models": [{"model": str(deep["base"])}, {"model": str(deep["a"])}]}
    run_recipe(recipe, tmp_path / "out")
    assert {t.dtype for t in tensors(tmp_path / "out").values()} == {torch.float16}
    assert read_config(tmp_path / "out")["dtype"] == "float16"


def test_slice_parameters_fall_back_source_then_slice_then_recipe(
    deep: dict[str, Path], tmp_path: Path,
) -> None:
    base, a = str(deep["base"]), str(deep["a"])
    recipe = {
        "merge_method": "task_arithmetic", "base_model": base, "dtype": "float32",
        "parameters": {"weight": 0.1},
        "slices": [
            {"sources": [src(base, 0, 2), src(a, 0, 2, weight=0.5)],
             "parameters": {"weight": 0.9}},
            {"sources": [src(base, 2, 4), src(a, 2, 4)], "parameters": {"weight": [
                {"filter": "mlp", "value": 0.9}]}},
        ],
    }
    run_recipe(recipe, tmp_path / "out")
    got, b, t = tensors(tmp_path / "out"), tensors(deep["base"]), tensors(deep["a"])

    def expect(name: str, w: float) -> torch.Tensor:
        return b[name] + w * (t[name] - b[name])

    cases = [("model.layers.0.mlp.up_proj.weight", 0.5),  # the source's own
             ("model.layers.2.mlp.up_proj.weight", 0.9),  # the slice's filter matches
             ("model.layers.3.self_attn.v_proj.weight", 0.1),  # falls through to the recipe
             ("lm_head.weight", 0.1)]  # last slice, no filter matches
    for name, w in cases:
        torch.testing.assert_close(got[name], expect(name, w), msg=name)


def test_a_failed_slices_merge_leaves_nothing(deep: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(RecipeError, match="exceeds"):
        run_recipe(passthrough(src(deep["short"], 0, 3)), out)
    assert leftovers(out) == []
