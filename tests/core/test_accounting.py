"""The manifest's accounting: every tensor stored in every input is merged, copied,
folded or left out with a reason, exactly once, for every method, slices, modules,
vocabulary unions, LoRA inputs, MAEC and MoE; a plan that drops a tensor fails with
``tensor_unaccounted`` and publishes nothing."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from maec_core.accounting import TIED_LM_HEAD
from maec_core.errors import TensorUnaccounted
from maec_core.maec.combine import CONTROLLED, NOT_ADDED
from maec_core.methods import all_methods
from maec_core.moe.config import parse_moe_config
from maec_core.plan import LM_HEAD
from tests.conformance.models import make_model
from tests.core.conftest import leftovers
from tests.core.test_lora import make_adapter
from tests.factories import make_extended, make_llama, run_recipe

# One valid recipe shape per registered method: whether it names the base, each model's
# parameters (one dict per model, a and b), the method's parameters.
METHODS: dict[str, tuple[bool, list[dict[str, Any]], dict[str, Any]]] = {
    "arcee_fusion": (True, [{}], {}),
    "breadcrumbs": (True, [{"weight": 0.5, "density": 0.8, "gamma": 0.05}] * 2, {}),
    "breadcrumbs_ties": (True, [{"weight": 0.5, "density": 0.8, "gamma": 0.05}] * 2, {}),
    "dare_linear": (True, [{"weight": 0.5, "density": 0.7}] * 2, {}),
    "dare_ties": (True, [{"weight": 0.5, "density": 0.7}] * 2, {}),
    "della": (True, [{"weight": 0.5, "density": 0.6, "epsilon": 0.1}] * 2, {}),
    "della_linear": (True, [{"weight": 0.5, "density": 0.6, "epsilon": 0.1}] * 2, {}),
    "karcher": (False, [{}, {}], {}),
    "layer_swap": (False, [{"role": "ability"}, {"role": "language"}],
                   {"bottom_k": 1, "top_k": 0}),
    "linear": (False, [{"weight": 0.3}, {"weight": 0.7}], {}),
    "model_stock": (True, [{}, {}], {}),
    "multislerp": (False, [{"weight": 0.5}, {"weight": 0.5}], {}),
    "nearswap": (True, [{}], {"t": 0.5}),
    "nuslerp": (False, [{"weight": 0.5}, {"weight": 0.5}], {}),
    "passthrough": (False, [{}], {}),
    "ram": (True, [{}, {}], {}),
    "ramplus_tl": (True, [{}, {}], {}),
    "sce": (True, [{}, {}], {}),
    "slerp": (True, [{}], {"t": 0.3}),
    "task_arithmetic": (True, [{"weight": 0.7}, {"weight": 0.4}], {}),
    "ties": (True, [{"weight": 0.7, "density": 0.5}, {"weight": 0.4, "density": 0.5}], {}),
}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("accounting")
    base = make_llama(root / "base", seed=0)
    zoo = {"base": base, **{k: make_llama(root / k, seed=i, like=base)
                            for i, k in enumerate("ab", start=1)}}
    zoo["tied"] = make_llama(root / "tied", seed=4, tie_word_embeddings=True)
    zoo["adapter"] = make_adapter(root / "adapter", base, seed=5)
    zoo["ext"] = make_extended(root / "ext", 3, like=base, words=["x0", "x1"])
    return zoo


def stored(*folders: Path) -> set[str]:
    """Every tensor name in the folders' safetensors files, read here on its own."""
    names: set[str] = set()
    for folder in folders:
        for f in folder.glob("*.safetensors"):
            with safe_open(str(f), "pt") as st:
                names |= set(st.keys())
    return names


def names_in(groups: dict[str, list[str]]) -> set[str]:
    return {n for ns in groups.values() for n in ns}


def accounting(out: Path, inputs: dict[str, set[str]]) -> dict[str, Any]:
    """The published manifest's accounting, checked to give every stored tensor of every
    input one disposition (counted once) and nothing else."""
    manifest = json.loads((out / "manifest.json").read_text())
    acc: dict[str, Any] = manifest["accounting"]
    assert set(acc) == set(manifest["inputs"]) == set(inputs)
    for key, names in inputs.items():
        a = acc[key]
        left = [n for ns in a["left_out_because"].values() for n in ns]
        assert len(left) == len(set(left)), f"{key}: a tensor left out for two reasons"
        folded = names_in(a["folded_into"])
        merged = names_in(a["merged_into"]) - folded
        copied = names_in(a["copied_to"]) - folded - merged
        used = folded | merged | copied
        assert used.isdisjoint(left), f"{key}: used and left out: {used & set(left)}"
        assert used | set(left) == names, (key, names - used - set(left),
                                            (used | set(left)) - names)
        assert (a["tensors"], a["merged"], a["copied"], a["folded"], a["left_out"]) == (
            len(names), len(merged), len(copied), len(folded), len(left)), key
    return acc


def test_every_registered_method_is_covered() -> None:
    assert {m.name for m in all_methods()} - {"maec"} == set(METHODS)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_accounts_for_every_input_tensor(zoo: dict[str, Path], tmp_path: Path,
                                                      method: str) -> None:
    with_base, models, params = METHODS[method]
    refs = [str(zoo[k]) for k in ("a", "b")[: len(models)]]
    recipe: dict[str, Any] = {
        "merge_method": method, "dtype": "float32", "parameters": params,
        "models": [{"model": r, "parameters": p} for r, p in zip(refs, models, strict=True)]}
    if with_base:
        recipe["base_model"] = str(zoo["base"])
    out = tmp_path / "out"
    run_recipe(recipe, out, device="cpu")
    keys = [*([str(zoo["base"])] if with_base else []), *refs]
    acc = accounting(out, {k: stored(Path(k)) for k in keys})
    for key in keys:
        # Nothing is left out of a models recipe over untied checkpoints.
        assert acc[key]["left_out"] == 0
    if len(keys) > 1 and method != "layer_swap":
        name = "model.layers.1.mlp.up_proj.weight"
        assert all(acc[k]["merged_into"][name] == [name] for k in keys)


def test_a_single_model_is_copied(zoo: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_recipe({"merge_method": "passthrough", "models": [{"model": str(zoo["a"])}]}, out)
    acc = accounting(out, {str(zoo["a"]): stored(zoo["a"])})[str(zoo["a"])]
    assert acc["copied"] == acc["tensors"] and acc["merged_into"] == {}
    assert acc["copied_to"][LM_HEAD] == [LM_HEAD]


def test_a_tied_reference_leaves_out_the_others_lm_head(zoo: dict[str, Path],
                                                         tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_recipe({"merge_method": "linear", "models": [
        {"model": str(zoo["tied"]), "parameters": {"weight": 0.5}},
        {"model": str(zoo["a"]), "parameters": {"weight": 0.5}}]}, out)
    acc = accounting(out, {str(zoo[k]): stored(zoo[k]) for k in ("tied", "a")})
    assert acc[str(zoo["a"])]["left_out_because"] == {TIED_LM_HEAD: [LM_HEAD]}
    assert acc[str(zoo["tied"])]["left_out"] == 0


def test_slices_leave_out_the_layers_outside_them(zoo: dict[str, Path], tmp_path: Path
                                                  ) -> None:
    out = tmp_path / "out"
    a, b = str(zoo["a"]), str(zoo["b"])
    run_recipe({"merge_method": "passthrough", "slices": [
        {"sources": [{"model": a, "layer_range": [0, 1]}]},
        {"sources": [{"model": b, "layer_range": [0, 1]}]},
        {"sources": [{"model": a, "layer_range": [0, 1]}]}]}, out)
    acc = accounting(out, {k: stored(Path(k)) for k in (a, b)})
    # Layer 0 of a twice (output layers 0 and 2), its layer 1 in no slice.
    q = "model.layers.{}.self_attn.q_proj.weight"
    assert acc[a]["copied_to"][q.format(0)] == [q.format(0)]
    assert acc[a]["copied_to"][q.format(2)] == [q.format(0)]
    assert acc[b]["copied_to"][q.format(1)] == [q.format(0)]
    outside = acc[a]["left_out_because"]["outside the slices: layer 1 is in no layer_range"]
    assert q.format(1) in outside and all(".layers.1." in n for n in outside)
    # b sits in the middle: its embedding, final norm and head come from a.
    assert {n for ns in acc[b]["left_out_because"].values() for n in ns} >= {
        "model.embed_tokens.weight", "model.norm.weight", LM_HEAD}


def test_modules_leave_out_the_modules_not_selected(tmp_path: Path) -> None:
    base = make_model(tmp_path / "vlm", "mistral3", seed=0)
    out = tmp_path / "out"
    run_recipe({"merge_method": "passthrough", "dtype": "float32", "modules": {
        "text_decoder": {"models": [{"model": str(base)}]}}}, out)
    acc = accounting(out, {str(base): stored(base)})[str(base)]
    reasons = acc["left_out_because"]
    vision = reasons["not in the modules selected (module vision_tower)"]
    assert vision and all(n.startswith("vision_tower.") for n in vision)
    assert reasons["not in the modules selected (module multi_modal_projector)"]
    assert acc["copied"] + acc["left_out"] == acc["tensors"]


def test_a_vocabulary_union_merges_every_embedding(zoo: dict[str, Path], tmp_path: Path
                                                   ) -> None:
    out = tmp_path / "out"
    refs = [str(zoo["base"]), str(zoo["ext"])]
    run_recipe({"merge_method": "linear", "tokenizer_source": "union", "dtype": "float32",
                "models": [{"model": r, "parameters": {"weight": 0.5}} for r in refs]}, out)
    acc = accounting(out, {r: stored(Path(r)) for r in refs})
    embed = "model.embed_tokens.weight"
    assert all(acc[r]["merged_into"][embed] == [embed] for r in refs)


def test_lora_matrices_are_folded_into_the_tensor_they_adapt(zoo: dict[str, Path],
                                                             tmp_path: Path) -> None:
    out = tmp_path / "out"
    base, adapter = str(zoo["base"]), str(zoo["adapter"])
    run_recipe({"merge_method": "task_arithmetic", "base_model": base, "models": [
        {"model": adapter, "parameters": {"weight": 1.0}}]}, out)
    acc = accounting(out, {base: stored(zoo["base"]),
                           adapter: stored(zoo["base"], zoo["adapter"])})
    q = "model.layers.0.self_attn.q_proj.weight"
    lora = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    assert acc[adapter]["folded_into"][q] == [lora.format("A"), lora.format("B")]
    assert acc[adapter]["merged_into"][q] == [q]
    assert acc[adapter]["folded"] == len(stored(zoo["adapter"]))


def test_a_lora_export_carries_the_merges_accounting(zoo: dict[str, Path], tmp_path: Path
                                                    ) -> None:
    base, a = str(zoo["base"]), str(zoo["a"])
    recipe: dict[str, Any] = {"merge_method": "task_arithmetic", "base_model": base,
                              "models": [{"model": a, "parameters": {"weight": 0.5}}]}
    run_recipe(recipe, tmp_path / "merged", device="cpu")
    run_recipe({**recipe, "output": {"format": "lora", "rank": 4}}, tmp_path / "lora",
               device="cpu")
    want = accounting(tmp_path / "merged", {base: stored(zoo["base"]), a: stored(zoo["a"])})
    assert accounting(tmp_path / "lora", {base: stored(zoo["base"]),
                                          a: stored(zoo["a"])}) == want


def test_maec_accounts_for_its_base_and_language_base(zoo: dict[str, Path], tmp_path: Path
                                                      ) -> None:
    out = tmp_path / "out"
    run_recipe({"merge_method": "maec", "base_model": str(zoo["base"]),
                "language_base": str(zoo["b"]), "abilities": [{"model": str(zoo["a"])}],
                "parameters": {"key_ratio": 0.2, "selection_ratio": 0.5}}, out, device="cpu")
    acc = accounting(out, {"base_model": stored(zoo["base"]),
                           "language_base": stored(zoo["b"])})
    lang, base = acc["language_base"], acc["base_model"]
    assert lang["left_out"] == 0
    # θ0 goes, through the ability vector, into exactly the tensors the ability adds
    # to, which merge the language base's; every other keeps the language base's.
    assert base["merged_into"] and base["left_out_because"]
    assert set(base["left_out_because"]) == {NOT_ADDED}
    assert base["merged_into"] == lang["merged_into"]
    assert set(lang["copied_to"]) == names_in(base["left_out_because"])


def test_maec_with_a_control_leaves_its_base_out_of_the_vectors(
        zoo: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_recipe({"merge_method": "maec", "base_model": str(zoo["base"]),
                "language_base": str(zoo["b"]),
                "abilities": [{"model": str(zoo["a"]), "control": str(zoo["tied"])}],
                "parameters": {"key_ratio": 0.2, "selection_ratio": 0.5}}, out, device="cpu")
    acc = accounting(out, {"base_model": stored(zoo["base"]),
                           "language_base": stored(zoo["b"])})
    # The vector is donor − control: θ0's values are in no output tensor.
    base, added = acc["base_model"], acc["language_base"]["merged_into"]
    assert base["left_out"] == base["tensors"] and added
    assert set(base["left_out_because"][CONTROLLED]) == set(added)


def test_moe_routes_each_experts_mlp_into_the_fused_tensors(zoo: dict[str, Path],
                                                          tmp_path: Path) -> None:
    from maec_core.moe.build import build_moe

    base, a, b = (str(zoo[k]) for k in ("base", "a", "b"))
    config = parse_moe_config({"base_model": base, "gate_mode": "random", "experts": [
        {"source_model": a}, {"source_model": b}]})
    out = tmp_path / "out"
    build_moe(config, out)
    acc = accounting(out, {r: stored(Path(r)) for r in (base, a, b)})
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    mlp = "model.layers.0.mlp.{}_proj.weight"
    assert acc[a]["merged_into"][fused] == [mlp.format("gate"), mlp.format("up")]
    assert acc[b]["merged_into"][fused] == [mlp.format("gate"), mlp.format("up")]
    dense = "a dense MLP tensor: the MoE layers take the experts' MLPs instead"
    assert mlp.format("down") in acc[base]["left_out_because"][dense]
    assert acc[base]["copied_to"][LM_HEAD] == [LM_HEAD]
    assert "model.embed_tokens.weight" in names_in(acc[a]["left_out_because"])


def test_a_published_manifest_names_accounted_inputs_by_reference(tmp_path: Path) -> None:
    from maec_core.accounting import Accounting, InputAccount
    from maec_core.job_plan import published_manifest
    from maec_core.manifest import build_manifest

    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "model.safetensors").write_bytes(b"x")

    def account(n: int) -> InputAccount:
        return InputAccount(n, n, 0, 0, 0, {}, {}, {}, {})

    acc = Accounting({str(copy): account(1), "language_base": account(2)})
    # The run is given each local copy's reference and names its manifest by it.
    made = build_manifest([], inputs={str(copy): {}}, recipe={}, accounting=acc,
                          names={str(copy): "s3://m/a"})
    doc = published_manifest(made, ["s3://m/a"], {"s3://m/a": str(copy)})
    assert {k: v["tensors"] for k, v in doc["accounting"].items()} == {
        "s3://m/a": 1, "language_base": 2}
    assert str(tmp_path) not in json.dumps(doc)


# --- a plan that drops a tensor ----------------------------------------------------


def _dropping(planner: Any, index: int = -1) -> Any:
    """``planner`` whose plan forgets one of its output tensors."""
    def drop(*args: Any, **kwargs: Any) -> Any:
        plan = planner(*args, **kwargs)
        tensors = list(plan.tensors)
        del tensors[index]
        return dataclasses.replace(plan, tensors=tensors)

    return drop


def test_a_method_plan_that_drops_a_tensor_fails_and_publishes_nothing(
        zoo: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import maec_core.method_plan as method_plan

    monkeypatch.setattr(method_plan, "build_plan", _dropping(method_plan.build_plan, 3))
    out = tmp_path / "out"
    with pytest.raises(TensorUnaccounted) as info:
        run_recipe({"merge_method": "task_arithmetic", "base_model": str(zoo["base"]),
                    "models": [{"model": str(zoo["a"]), "parameters": {"weight": 1.0}}]},
                   out)
    assert info.value.code == "tensor_unaccounted"
    dropped = sorted(stored(zoo["base"]))
    missing = info.value.details["tensors"]
    assert set(missing) == {str(zoo["base"]), str(zoo["a"])}
    assert all(len(v) == 1 and v[0] in dropped for v in missing.values())
    assert not out.exists() and leftovers(out) == []


def test_maec_merge_reports_the_code_and_writes_nothing(
        zoo: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml
    from click.testing import CliRunner

    import maec_core.method_plan as method_plan
    from maec_core.cli import main

    monkeypatch.setattr(method_plan, "build_plan", _dropping(method_plan.build_plan))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"merge_method": "linear", "models": [
        {"model": str(zoo["a"]), "parameters": {"weight": 1.0}}]}))
    out = tmp_path / "merged"
    result = CliRunner().invoke(main, ["merge", "--no-progress", str(recipe), str(out)])
    assert result.exit_code == 2 and "[tensor_unaccounted]" in result.stderr
    assert "model.norm.weight" in result.stderr and leftovers(out) == []


def test_a_slices_plan_that_drops_a_tensor_fails(zoo: dict[str, Path], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import maec_core.slices as slices

    planner = slices.build_slice_plan

    def drop(*args: Any, **kwargs: Any) -> Any:
        sliced = planner(*args, **kwargs)
        plan = dataclasses.replace(sliced.plan, tensors=sliced.plan.tensors[1:])
        return dataclasses.replace(sliced, plan=plan, calls=sliced.calls[1:])

    monkeypatch.setattr(slices, "build_slice_plan", drop)
    out = tmp_path / "out"
    with pytest.raises(TensorUnaccounted, match=r"model\.embed_tokens\.weight"):
        run_recipe({"merge_method": "passthrough", "slices": [
            {"sources": [{"model": str(zoo["a"]), "layer_range": [0, 2]}]}]}, out)
    assert not out.exists()


def test_a_maec_combination_that_skips_a_tensor_fails(
        zoo: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import maec_core.maec.pipeline as pipeline

    monkeypatch.setattr(pipeline, "build_plan", _dropping(pipeline.build_plan))
    out = tmp_path / "out"
    with pytest.raises(TensorUnaccounted):
        run_recipe({"merge_method": "maec", "base_model": str(zoo["base"]),
                    "language_base": str(zoo["b"]), "abilities": [{"model": str(zoo["a"])}],
                    "parameters": {"key_ratio": 0.2}}, out, device="cpu")
    assert not out.exists()


def test_an_moe_plan_that_drops_a_tensor_fails(zoo: dict[str, Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import maec_core.moe.build as build

    monkeypatch.setattr(build, "plan_moe", _dropping(build.plan_moe, 0))
    base, a, b = (str(zoo[k]) for k in ("base", "a", "b"))
    config = parse_moe_config({"base_model": base, "gate_mode": "random", "experts": [
        {"source_model": a}, {"source_model": b}]})
    out = tmp_path / "out"
    with pytest.raises(TensorUnaccounted, match=r"model\.embed_tokens\.weight"):
        build.build_moe(config, out)
    assert not out.exists()
