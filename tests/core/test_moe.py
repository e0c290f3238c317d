"""Mixtures of experts from dense checkpoints, against mergekit-moe 0.1.5 in the same run.

Every case of ``tests/conformance/moe_suite.py`` runs through both tools: both accept or
both refuse, and accepted ones give the same tensors (bit for bit for the deterministic
gate modes, by statistics for the random ones) and config.json. The outputs load and
generate in transformers; the command line, warnings and refusals are checked here too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner

from maec_core.context import RunContext
from maec_core.errors import (
    Cancelled,
    NonFiniteOutput,
    OutputExists,
    PickleRefused,
    RecipeError,
    UnsupportedMoe,
)
from maec_core.moe.build import build_moe
from maec_core.moe.config import parse_moe_config
from tests.conformance.moe_suite import CASES, A, B, C, Case, make_family, run_case, tensors
from tests.core.conftest import leftovers


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, torch.dtype],
                                                             dict[str, Path]]:
    root = tmp_path_factory.mktemp("moe-families")
    return {(c.family, c.dtype): make_family(root / f"{c.family}-{str(c.dtype)[6:]}",
                                             c.family, c.dtype)
            for c in CASES}


@pytest.fixture(scope="module")
def llama(families: dict[tuple[str, torch.dtype], dict[str, Path]]) -> dict[str, Path]:
    return families[("llama", torch.float32)]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_mergekit_moe(case: Case, families: dict[tuple[str, torch.dtype],
                                                          dict[str, Path]],
                              tmp_path: Path) -> None:
    outcome = run_case(case, families[(case.family, case.dtype)], tmp_path)
    if case.expect == "refused":
        assert not outcome.ours_accepted and not outcome.theirs_accepted
    else:
        assert outcome.ours_accepted and outcome.theirs_accepted
    assert outcome.equal, outcome.problems


def _config(m: dict[str, Path], **top: Any) -> dict[str, Any]:
    return {"base_model": str(m["base"]), "gate_mode": "cheap_embed",
            "experts": [{"source_model": str(m["a"]), "positive_prompts": A},
                        {"source_model": str(m["b"]), "positive_prompts": B}], **top}


@pytest.mark.parametrize("family,shared,arch", [("llama", False, "mixtral"),
                                               ("qwen2", True, "qwen2_moe"),
                                               ("qwen3", False, "qwen3_moe")])
def test_transformers_loads_and_generates(family: str, shared: bool, arch: str,
                                          families: dict[tuple[str, torch.dtype],
                                                         dict[str, Path]],
                                          tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = families[(family, torch.float32)]
    extra = {"shared_experts": [{"source_model": str(m["base"]),
                                 "positive_prompts": C}]} if shared else {}
    out = tmp_path / "moe"
    result = build_moe(parse_moe_config(_config(m, **extra)), out)
    assert result.report is not None
    assert result.report["architecture"] == arch
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert model.config.model_type == arch
    # Every weight of the model is in the files, and nothing else is.
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("w3 w4 w5", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=4, do_sample=False)
        logits = model(ids).logits
    assert gen.shape == (1, ids.shape[1] + 4)
    assert torch.isfinite(logits).all()


def test_cli_builds_and_warns(llama: dict[str, Path], tmp_path: Path) -> None:
    from importlib.metadata import entry_points

    # ``maec moe`` is this command, added to the client's ``maec`` script.
    (point,) = [ep for ep in entry_points(group="maec.commands") if ep.name == "moe"]
    main = point.load()
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump(_config(llama, tokenizer_source="base")))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, [str(path), str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "mixtral, 2 experts" in result.stdout
    assert "warning: tokenizer_source: not read by mergekit-moe, ignored" in result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["moe"]["warnings"] == ["tokenizer_source: not read by mergekit-moe, "
                                           "ignored"]
    assert "tokenizer_source" in (out / "README.md").read_text()
    assert {f["path"] for f in manifest["files"]} >= {"model.safetensors", "config.json",
                                                      "tokenizer.json", "moe_config.yaml"}
    again = CliRunner().invoke(main, [str(path), str(out), "--no-progress"])
    assert again.exit_code == 2 and "[output_exists]" in again.stderr


def test_cli_refuses_with_code(llama: dict[str, Path], tmp_path: Path) -> None:
    from maec_core.moe.cli import moe_command

    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump(_config(llama, gate_mode="sideways")))
    result = CliRunner().invoke(moe_command, [str(path), str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "[invalid_recipe]" in result.stderr and "gate_mode" in result.stderr
    assert "Traceback" not in result.output


def test_all_same_experts_need_the_flag(llama: dict[str, Path], tmp_path: Path) -> None:
    doc = _config(llama)
    doc["experts"][1]["source_model"] = str(llama["a"])
    with pytest.raises(RecipeError, match="same model"):
        parse_moe_config(doc)
    out = tmp_path / "same"
    build_moe(parse_moe_config(doc, allow_all_same=True), out)
    t = tensors(out)["model.layers.0.mlp.experts.down_proj"]
    assert torch.equal(t[0], t[1])


def test_deepseek_output_is_refused_by_name(llama: dict[str, Path], tmp_path: Path) -> None:
    # mergekit-moe makes a DeepSeek MoE of a Llama with an unprompted shared expert.
    doc = _config(llama, shared_experts=[{"source_model": str(llama["c"])}])
    with pytest.raises(UnsupportedMoe, match="DeepSeek MoE") as err:
        build_moe(parse_moe_config(doc), tmp_path / "out")
    assert err.value.code == "unsupported_moe"
    assert leftovers(tmp_path / "out") == []


def test_pickle_expert_refused_before_anything(llama: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "pickled"
    bad.mkdir()
    (bad / "config.json").write_text((llama["a"] / "config.json").read_text())
    torch.save({"x": torch.zeros(1)}, bad / "pytorch_model.bin")
    doc = _config(llama)
    doc["experts"][1]["source_model"] = str(bad)
    with pytest.raises(PickleRefused):
        build_moe(parse_moe_config(doc), tmp_path / "out")
    assert leftovers(tmp_path / "out") == []


def test_failures_leave_nothing(llama: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    # An expert with a NaN in its last layer's MLP: found while writing, mid-output.
    nan = tmp_path / "nan"
    nan.mkdir()
    for f in llama["b"].iterdir():
        (nan / f.name).write_bytes(f.read_bytes())
    weights = load_file(nan / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(weights, nan / "model.safetensors", metadata={"format": "pt"})
    doc = _config(llama)
    doc["experts"][1]["source_model"] = str(nan)
    with pytest.raises(NonFiniteOutput):
        build_moe(parse_moe_config(doc), tmp_path / "out")
    assert leftovers(tmp_path / "out") == []
    calls: list[int] = []

    def cancel() -> bool:
        calls.append(1)
        return len(calls) > 5

    with pytest.raises(Cancelled):
        build_moe(parse_moe_config(_config(llama)), tmp_path / "out",
                  RunContext(cancel=cancel))
    assert leftovers(tmp_path / "out") == []
    (tmp_path / "out").mkdir()
    with pytest.raises(OutputExists):
        build_moe(parse_moe_config(_config(llama)), tmp_path / "out")


def test_progress_counts_every_tensor(llama: dict[str, Path], tmp_path: Path) -> None:
    seen: list[tuple[str, int, int]] = []
    result = build_moe(parse_moe_config(_config(llama)), tmp_path / "out",
                       RunContext(progress=lambda s, d, t: seen.append((s, d, t))))
    assert seen[-1] == ("moe", result.tensors, result.tensors)
    assert len(seen) == result.tensors


def test_noise_is_seeded_and_of_its_scale(llama: dict[str, Path], tmp_path: Path) -> None:
    def build(seed: int, where: str) -> dict[str, torch.Tensor]:
        doc = _config(llama, random_seed=seed)
        doc["experts"][0]["noise_scale"] = 0.1
        build_moe(parse_moe_config(doc), tmp_path / where)
        return tensors(tmp_path / where)

    first, again, other = build(1, "a"), build(1, "b"), build(2, "c")
    name = "model.layers.0.mlp.experts.down_proj"
    assert torch.equal(first[name], again[name])
    assert not torch.equal(first[name], other[name])
    from safetensors.torch import load_file

    source = load_file(llama["a"] / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    noise = first[name][0] - source
    assert abs(float(noise.std()) - 0.1) < 0.02 and abs(float(noise.mean())) < 0.02
    # The expert without noise_scale is its model's weights exactly.
    b = load_file(llama["b"] / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(first[name][1], b)


def test_the_mergekit_moe_command_agrees(llama: dict[str, Path], tmp_path: Path) -> None:
    """The installed ``mergekit-moe`` command itself (not only its build function) on a
    config file, against ``maec moe`` on the same file."""
    import subprocess
    import sys

    from maec_core.moe.cli import moe_command
    from tests.conformance.moe_suite import compare

    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump(_config(llama, gate_mode="hidden", dtype="bfloat16")))
    theirs = tmp_path / "mergekit"
    command = Path(sys.executable).parent / "mergekit-moe"
    done = subprocess.run([str(command), str(path), str(theirs), "--device", "cpu"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ours = tmp_path / "ours"
    result = CliRunner().invoke(moe_command, [str(path), str(ours), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert compare(ours, theirs, "equal") == []
