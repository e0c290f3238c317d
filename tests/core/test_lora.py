"""LoRA adapters as merge inputs and as merge outputs, checked against peft itself.

Adapters are made by peft on a tiny local base and saved with safetensors; a merge with
the adapter must equal the merge with peft's ``merge_and_unload`` of it, and an exported
adapter must load in peft and reproduce the truncated SVD of the merge's delta.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from maec_core.cli import main
from maec_core.context import RunContext
from maec_core.errors import CheckpointError, MaecError, RecipeError
from maec_core.io.folder import open_model_folder
from maec_core.io.reader import TensorReader
from maec_core.lora.export import low_rank_factors, select_targets
from maec_core.maec.pipeline import extract
from maec_core.maec.rowio import RowReader
from maec_core.parsing import parse_recipe
from tests.factories import make_llama, run_recipe

TARGETS = ["q_proj", "v_proj", "down_proj"]
# Float32 on both sides; the only difference is the order of float32 additions.
ATOL = 1e-6


def make_adapter(path: Path, base: Path, seed: int, **config: Any) -> Path:
    """A peft LoRA adapter on ``base`` with random (non-zero) A and B, saved by peft."""
    safe = bool(config.pop("safe_serialization", True))
    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "init_lora_weights": False,
           **config}
    peft_model = get_peft_model(model, LoraConfig(**cfg))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)  # large enough that every delta matters
    peft_model.save_pretrained(str(path), safe_serialization=safe)
    return path


def merged_by_peft(path: Path, base: Path, adapter: Path) -> Path:
    """The full model peft makes of ``adapter`` on ``base`` (``merge_and_unload``)."""
    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(path)
    return path


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                 atol: float = ATOL) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = make_llama(root / "base", seed=0)
    adapter = make_adapter(root / "adapter", base, seed=5)
    rslora = make_adapter(root / "rslora", base, seed=6, use_rslora=True, r=8, lora_alpha=4)
    return {
        "base": base,
        "ft": make_llama(root / "ft", seed=1, like=base),
        "lang": make_llama(root / "lang", seed=2, like=base),
        "adapter": adapter,
        "adapter_full": merged_by_peft(root / "adapter_full", base, adapter),
        "rslora": rslora,
        "rslora_full": merged_by_peft(root / "rslora_full", base, rslora),
    }


# --- the adapter as a checkpoint ---------------------------------------------------


@pytest.mark.parametrize("which", ["adapter", "rslora"])
def test_adapter_reads_as_peft_merged_model(lora: dict[str, Path], which: str) -> None:
    # The base named in adapter_config.json, followed only when the caller allows it.
    with pytest.raises(CheckpointError, match="name its base in the recipe"):
        open_model_folder(lora[which])
    folder = open_model_folder(lora[which], config_base=True)
    full = weights(lora[f"{which}_full"])
    base = weights(lora["base"])
    targeted = [n for n, i in folder.tensors.items() if i.delta is not None]
    assert len(targeted) == 2 * len(TARGETS)  # two layers
    with TensorReader() as reader:
        got = {n: reader.read(i) for n, i in folder.tensors.items()}
    assert_close(got, full)
    for n in targeted:
        assert not torch.equal(full[n], base[n]), n  # the deltas are not zero
    # Row reads (MAEC's path) form only the rows asked for, with the same values.
    name = "model.layers.1.mlp.down_proj.weight"
    info = folder.tensors[name]
    rows = torch.tensor([0, 3, 4, 17, 31])
    with RowReader() as io:
        torch.testing.assert_close(io.read_rows(info, rows), full[name][rows], atol=ATOL,
                                   rtol=0)
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        torch.testing.assert_close(io.read_row_range(info, 5, 9, buf), full[name][5:9],
                                   atol=ATOL, rtol=0)
        torch.testing.assert_close(io.read(info), full[name], atol=ATOL, rtol=0)


def test_a_bf16_base_gets_the_delta_as_peft_adds_it(tmp_path: Path) -> None:
    # peft keeps the adapter in float32 and adds its delta to the bf16 weight in place;
    # the reader's float32 sum rounded once to bf16 is the same number.
    base = make_llama(tmp_path / "base", seed=4, dtype=torch.bfloat16)
    adapter = make_adapter(tmp_path / "adapter", base, seed=9)
    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    full = PeftModel.from_pretrained(model, adapter).merge_and_unload().state_dict()
    folder = open_model_folder(adapter, base=base)
    with TensorReader() as reader:
        for name, info in folder.tensors.items():
            got = reader.read(info)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got, full[name], atol=0, rtol=0, msg=name)


def test_recipe_base_wins_over_the_adapter_config(lora: dict[str, Path],
                                                  tmp_path: Path) -> None:
    adapter = tmp_path / "moved"
    adapter.mkdir()
    for f in lora["adapter"].iterdir():
        (adapter / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = "meta-llama/not-here"
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="not a local checkpoint folder"):
        open_model_folder(adapter, config_base=True)
    folder = open_model_folder(adapter, base=lora["base"])
    assert folder.base is not None and folder.base.root == lora["base"]
    # The adapter's config is an input as much as its weights (it sets the scale).
    assert adapter / "adapter_config.json" in folder.weight_files


# Per-model parameters of every task-vector method (and two others that use a base).
TASK_METHODS: dict[str, dict[str, float]] = {
    "task_arithmetic": {},
    "ties": {"density": 0.6},
    "dare_ties": {"density": 0.6},
    "dare_linear": {"density": 0.6},
    "breadcrumbs": {"density": 0.8, "gamma": 0.05},
    "breadcrumbs_ties": {"density": 0.8, "gamma": 0.05},
    "della": {"density": 0.6, "epsilon": 0.1},
    "della_linear": {"density": 0.6, "epsilon": 0.1},
    "sce": {},
    "model_stock": {},
}


def test_every_task_vector_method_is_covered() -> None:
    from maec_core.methods import all_methods

    task_vector = {m.name for m in all_methods() if "lambda_" in m.params.model_fields}
    assert task_vector <= set(TASK_METHODS), task_vector - set(TASK_METHODS)


@pytest.mark.parametrize("method", sorted(TASK_METHODS))
def test_task_methods_take_an_adapter_like_its_merged_model(
        lora: dict[str, Path], tmp_path: Path, method: str) -> None:
    def recipe(model: Path) -> dict[str, Any]:
        extra: dict[str, float] = TASK_METHODS[method]
        if method not in ("sce", "model_stock"):
            extra = {"weight": 0.7, **extra}
        return {"merge_method": method, "base_model": str(lora["base"]), "models": [
            {"model": str(lora["ft"]), "parameters": extra},
            {"model": str(model), "parameters": extra},
        ]}

    run_recipe(recipe(lora["adapter"]), tmp_path / "with_adapter", device="cpu")
    run_recipe(recipe(lora["adapter_full"]), tmp_path / "with_full", device="cpu")
    assert_close(weights(tmp_path / "with_adapter"), weights(tmp_path / "with_full"))


def test_an_adapter_as_the_only_model(lora: dict[str, Path], tmp_path: Path) -> None:
    # Element-wise streaming (linear): the adapter's tensors are formed, then sliced.
    r = {"merge_method": "linear", "models": [
        {"model": str(lora["rslora"]), "parameters": {"weight": 1.0}}]}
    res = run_recipe(r, tmp_path / "out", device="cpu")
    assert_close(weights(tmp_path / "out"), weights(lora["rslora_full"]))
    files = res.manifest["inputs"][str(lora["rslora"])]["files"]  # type: ignore[attr-defined]
    assert {"model.safetensors", "adapter_model.safetensors", "adapter_config.json"} <= set(files)


@pytest.mark.parametrize("granularity", ["row", "element"])
def test_maec_takes_an_adapter_donor_like_its_merged_model(
        lora: dict[str, Path], tmp_path: Path, granularity: str) -> None:
    def recipe(donor: Path) -> dict[str, Any]:
        return {"merge_method": "maec", "base_model": str(lora["base"]),
                "language_base": str(lora["lang"]), "abilities": [{"model": str(donor)}],
                "parameters": {"key_ratio": 0.2, "granularity": granularity}}

    run_recipe(recipe(lora["adapter"]), tmp_path / "with_adapter", device="cpu")
    run_recipe(recipe(lora["adapter_full"]), tmp_path / "with_full", device="cpu")
    got, want = weights(tmp_path / "with_adapter"), weights(tmp_path / "with_full")
    assert_close(got, want)
    assert any(not torch.equal(want[k], weights(lora["lang"])[k]) for k in want)


# --- refusals ----------------------------------------------------------------------


def test_a_pickled_adapter_is_refused(lora: dict[str, Path], tmp_path: Path) -> None:
    pickled = make_adapter(tmp_path / "pickled", lora["base"], seed=7,
                           safe_serialization=False)
    assert (pickled / "adapter_model.bin").is_file()
    assert not (pickled / "adapter_model.safetensors").exists()
    with pytest.raises(MaecError) as exc:
        run_recipe({"merge_method": "task_arithmetic", "base_model": str(lora["base"]),
                    "models": [{"model": str(pickled), "parameters": {"weight": 1.0}}]},
                   tmp_path / "out", device="cpu")
    assert exc.value.code == "pickle_refused"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("config", "field"), [
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "lora_only"}, "bias"),
    ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
])
def test_unsupported_adapters_are_refused_with_a_code(
        lora: dict[str, Path], tmp_path: Path, config: dict[str, Any], field: str) -> None:
    adapter = make_adapter(tmp_path / "ad", lora["base"], seed=8, **config)
    with pytest.raises(MaecError) as exc:
        open_model_folder(adapter)
    assert exc.value.code == "unsupported_adapter"
    assert exc.value.details.get("field") == field


def test_an_adapter_for_another_base_is_refused_from_headers(
        lora: dict[str, Path], tmp_path: Path) -> None:
    other = make_llama(tmp_path / "wide", seed=3, hidden_size=48, num_attention_heads=4)
    with pytest.raises(CheckpointError, match="another base") as exc:
        open_model_folder(lora["adapter"], base=other)
    assert exc.value.code == "invalid_checkpoint"


def test_a_lora_tensor_with_a_foreign_name_is_refused(lora: dict[str, Path],
                                                      tmp_path: Path) -> None:
    from safetensors.torch import save_file

    adapter = tmp_path / "ad"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_bytes(
        (lora["adapter"] / "adapter_config.json").read_bytes())
    tensors = load_file(str(lora["adapter"] / "adapter_model.safetensors"))
    tensors["base_model.model.lm_head.weight"] = torch.zeros(64, 32)  # a full module
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(MaecError) as exc:
        open_model_folder(adapter)
    assert exc.value.code == "unsupported_adapter"


# --- export ------------------------------------------------------------------------


def _ta(lora: dict[str, Path], output: dict[str, Any] | None = None) -> dict[str, Any]:
    r: dict[str, Any] = {"merge_method": "task_arithmetic", "base_model": str(lora["base"]),
                         "models": [{"model": str(lora["ft"]), "parameters": {"weight": 0.7}},
                                    {"model": str(lora["adapter"]),
                                     "parameters": {"weight": 0.5}}]}
    if output is not None:
        r["output"] = output
    return r


def _peft_delta(base: Path, adapter: Path) -> dict[str, torch.Tensor]:
    """What peft adds to each base tensor when it loads and merges ``adapter``."""
    merged = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(merged, adapter).merge_and_unload()
    before = weights(base)
    return {k: v.detach() - before[k] for k, v in merged.state_dict().items() if k in before}


def test_full_rank_export_reproduces_the_merge(lora: dict[str, Path], tmp_path: Path) -> None:
    run_recipe(_ta(lora), tmp_path / "model", device="cpu")
    res: Any = run_recipe(_ta(lora, {"format": "lora", "rank": 32}), tmp_path / "lora",
                          device="cpu")
    out = tmp_path / "lora"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["adapter_config.json", "adapter_model.safetensors", "lora_report.json",
         "manifest.json", "recipe.yaml"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left
    report = json.loads((out / "lora_report.json").read_text())
    assert len(report["modules"]) == 14  # 7 weights in each of 2 layers
    assert all(m["retained_energy"] == pytest.approx(1.0, abs=1e-6)
               for m in report["modules"].values())
    # The merge changed the norms and embeddings too: no adapter carries them.
    assert "model.embed_tokens.weight" in report["untargeted_changed"]
    assert res.report["lora"]["modules"] == 14
    merged, base = weights(tmp_path / "model"), weights(lora["base"])
    delta = _peft_delta(lora["base"], out)
    for name in select_targets(((k, tuple(v.shape)) for k, v in base.items()), None):
        torch.testing.assert_close(delta[name], merged[name] - base[name], atol=1e-5,
                                   rtol=0, msg=name)
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(lora["base"])
    assert cfg["r"] == 32 and cfg["lora_alpha"] == 32


def test_low_rank_export_is_the_truncated_svd(lora: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "lora"
    res: Any = run_recipe(_ta(lora, {"format": "lora", "rank": 3,
                                     "target_modules": ["q_proj", "mlp.up_proj"]}),
                          out, device="cpu")
    run_recipe(_ta(lora), tmp_path / "model", device="cpu")
    merged, base = weights(tmp_path / "model"), weights(lora["base"])
    report = json.loads((out / "lora_report.json").read_text())
    assert sorted(report["modules"]) == sorted(
        f"model.layers.{i}.{m}" for i in (0, 1) for m in ("self_attn.q_proj", "mlp.up_proj"))
    delta = _peft_delta(lora["base"], out)
    for module, entry in report["modules"].items():
        name = module + ".weight"
        d = (merged[name] - base[name]).double()
        u, s, vh = torch.linalg.svd(d, full_matrices=False)
        best = (u[:, :3] * s[:3]) @ vh[:3]
        torch.testing.assert_close(delta[name].double(), best, atol=1e-5, rtol=0, msg=name)
        energy = float(s[:3].square().sum() / s.square().sum())
        assert entry["retained_energy"] == pytest.approx(energy, abs=1e-5)
        assert entry["retained_energy"] < 1.0
    assert res.report["lora"]["retained_energy_min"] < 1.0


def test_a_cancelled_export_leaves_nothing(lora: dict[str, Path], tmp_path: Path) -> None:
    stages: list[str] = []
    out = tmp_path / "job" / "lora"
    with pytest.raises(MaecError) as exc:
        run_recipe(_ta(lora, {"format": "lora", "rank": 2}), out, device="cpu",
                   progress=lambda stage, done, total: stages.append(stage),
                   cancel=lambda: "lora" in stages)
    assert exc.value.code == "cancelled"
    assert "merge" in stages  # the merge itself finished; the export was stopped
    assert list((tmp_path / "job").iterdir()) == []  # neither the merge nor the adapter


def test_low_rank_factors_pad_a_narrow_module() -> None:
    d = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    a, b, energy = low_rank_factors(d, 8)
    assert a.shape == (8, 4) and b.shape == (16, 8)
    torch.testing.assert_close(b @ a, d, atol=1e-5, rtol=0)
    assert energy == pytest.approx(1.0)
    a, b, energy = low_rank_factors(torch.zeros(5, 5), 2)
    assert energy == 1.0 and not b.any()


def test_a_maec_merge_exports_against_its_language_base(lora: dict[str, Path],
                                                         tmp_path: Path) -> None:
    r = {"merge_method": "maec", "base_model": str(lora["base"]),
         "language_base": str(lora["lang"]), "abilities": [{"model": str(lora["adapter"])}],
         "parameters": {"key_ratio": 0.2}}
    run_recipe(r, tmp_path / "model", device="cpu")
    run_recipe({**r, "output": {"format": "lora", "rank": 32}}, tmp_path / "lora", device="cpu")
    merged, lang = weights(tmp_path / "model"), weights(lora["lang"])
    delta = _peft_delta(lora["lang"], tmp_path / "lora")
    changed = [k for k in merged if not torch.equal(merged[k], lang[k])]
    assert changed
    for name in changed:
        torch.testing.assert_close(delta[name], merged[name] - lang[name], atol=1e-5, rtol=0)


@pytest.mark.parametrize(("output", "words"), [
    ({"format": "lora"}, "needs a rank"),
    ({"format": "model", "rank": 4}, "format lora only"),
    ({"format": "lora", "rank": 0}, "greater than or equal to 1"),
    ({"format": "gguf"}, "format"),
])
def test_bad_output_specs_are_recipe_errors(lora: dict[str, Path], output: dict[str, Any],
                                            words: str) -> None:
    with pytest.raises(RecipeError, match=words):
        parse_recipe(_ta(lora, output))


def test_a_lora_export_needs_a_base(lora: dict[str, Path]) -> None:
    with pytest.raises(RecipeError, match="needs a base"):
        parse_recipe({"merge_method": "linear", "output": {"format": "lora", "rank": 2},
                      "models": [{"model": str(lora["ft"]), "parameters": {"weight": 1.0}}]})


def test_target_modules_that_match_nothing_fail_before_publishing(
        lora: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="match no 2-D weight"):
        run_recipe(_ta(lora, {"format": "lora", "rank": 2, "target_modules": ["qkv_proj"]}),
                   tmp_path / "out", device="cpu")
    assert not list(tmp_path.iterdir())


def test_extract_lora_cli_writes_the_ability_vector(lora: dict[str, Path],
                                                    tmp_path: Path) -> None:
    recipe = parse_recipe({"merge_method": "maec", "base_model": str(lora["base"]),
                           "language_base": str(lora["lang"]),
                           "abilities": [{"model": str(lora["ft"])}],
                           "parameters": {"key_ratio": 0.25}})
    art = tmp_path / "art"
    extract(recipe, 0, art, RunContext(device="cpu"))
    out = tmp_path / "adapter"
    result = CliRunner().invoke(main, ["extract-lora", str(art), str(out), "--rank", "32",
                                       "--base", str(lora["lang"]), "--no-progress",
                                       "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "retained energy min 1.0000" in result.output
    stored = load_file(str(art / "ability.safetensors"))
    delta = _peft_delta(lora["lang"], out)
    report = json.loads((out / "lora_report.json").read_text())
    for module in report["modules"]:
        name = module + ".weight"
        dense = torch.zeros_like(delta[name])
        if name + "::index" in stored:
            dense[stored[name + "::index"]] = stored[name + "::delta"].float()
        torch.testing.assert_close(delta[name], dense, atol=1e-5, rtol=0, msg=name)
    assert math.isclose(report["retained_energy_min"], 1.0, abs_tol=1e-6)
    again = CliRunner().invoke(main, ["extract-lora", str(art), str(out), "--rank", "2",
                                      "--no-progress"])
    assert again.exit_code == 2 and "output_exists" in again.output
