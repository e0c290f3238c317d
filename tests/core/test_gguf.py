"""GGUF in and out on a tiny Llama: header checks and refusals with typed codes, the
dequantized folder, the written file's metadata (read back by gguf's reader), and
``maec merge`` with a GGUF model and ``--gguf``."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
import yaml
from click.testing import CliRunner

from maec_core.cli import main
from maec_core.errors import InvalidGguf, UnsupportedGguf, UnsupportedGgufOutput
from maec_core.gguf.header import ARCHITECTURES, check_readable, find_gguf, read_header
from maec_core.gguf.sources import dequantized, gguf_file_of
from maec_core.gguf.writer import check_type
from maec_core.io.folder import open_model_folder
from tests.gguf_factory import CHAT_TEMPLATE, foreign_gguf, tiny_gguf, tiny_hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    base = tiny_hf(root / "base", seed=0)
    other = tiny_hf(root / "other", seed=1, like=base)
    (root / "ggdir").mkdir()
    return {"base": base, "other": other,
            "gguf": tiny_gguf(other, root / "ggdir" / "other.Q8_0.gguf")}


def test_the_architecture_list_is_transformers_own() -> None:
    # The API cannot import transformers, so the list is written out: it must not drift.
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    assert set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"} == ARCHITECTURES


def test_header_of_a_written_file(tiny: dict[str, Path]) -> None:
    header = read_header(tiny["gguf"])
    assert header.architecture == "llama" and header.quantization == "Q8_0"
    assert header.tensor_types == {"Q8_0": 16, "F32": 5}
    assert header.data_end == tiny["gguf"].stat().st_size
    check_readable(header, "x")  # no refusal


def test_bad_files_get_typed_codes(tiny: dict[str, Path], tmp_path: Path) -> None:
    data = tiny["gguf"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) - 100])
    with pytest.raises(InvalidGguf, match="truncated"):
        read_header(cut)
    (tmp_path / "header-cut.gguf").write_bytes(data[:300])
    with pytest.raises(InvalidGguf):
        read_header(tmp_path / "header-cut.gguf")
    # A pickle renamed .gguf is refused by its first four bytes, never unpickled.
    pickled = tmp_path / "pickle.gguf"
    pickled.write_bytes(b"\x80\x04\x95" + b"\x00" * 64)
    with pytest.raises(InvalidGguf, match="no GGUF magic"):
        read_header(pickled)
    with pytest.raises(UnsupportedGguf, match="'bert'") as exc:
        check_readable(read_header(foreign_gguf(tmp_path / "bert.gguf")), "bert.gguf")
    assert exc.value.code == "unsupported_gguf"
    q81 = foreign_gguf(tmp_path / "q81.gguf", "llama", gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(UnsupportedGguf, match="Q8_1"):
        check_readable(read_header(q81), "q81.gguf")
    with pytest.raises(UnsupportedGgufOutput, match="q4_k") as out:
        check_type("q4_k")
    assert out.value.code == "unsupported_gguf_output"


def test_readers_say_gguf_where_no_gguf_step_ran(tiny: dict[str, Path]) -> None:
    for where in (tiny["gguf"], tiny["gguf"].parent):
        with pytest.raises(Exception, match="GGUF") as exc:
            open_model_folder(where)
        assert exc.value.code == "invalid_checkpoint"  # type: ignore[attr-defined]
    assert gguf_file_of(tiny["gguf"].parent) == tiny["gguf"]
    assert find_gguf(["a.safetensors", "x.gguf"]) == "x.gguf"
    with pytest.raises(UnsupportedGguf, match="2 GGUF files"):
        find_gguf(["a.gguf", "b.gguf"])


def test_dequantized_folder_matches_the_file(tiny: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    g = dequantized(tiny["gguf"], tmp_path / "cache")
    assert g.info["quantization"] == "Q8_0" and len(g.info["sha256"]) == 64
    assert g.folder.name == g.info["sha256"] and "lossy" in g.warning
    again = dequantized(tiny["gguf"], tmp_path / "cache")  # cached by content
    assert again.folder == g.folder
    src = AutoModelForCausalLM.from_pretrained(tiny["other"], dtype=torch.float32)
    deq = AutoModelForCausalLM.from_pretrained(g.folder, dtype=torch.float32)
    for (name, a), (_, b) in zip(src.state_dict().items(), deq.state_dict().items(),
                                 strict=True):
        # q8_0: one byte per weight and a scale per 32: |error| <= scale / 2.
        assert torch.allclose(a, b, atol=a.abs().max().item() / 127), name


def test_cli_merges_a_gguf_model_and_writes_gguf(tiny: dict[str, Path], tmp_path: Path
                                                 ) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "merge_method": "task_arithmetic", "base_model": str(tiny["base"]),
        "models": [{"model": str(tiny["gguf"]), "parameters": {"weight": 0.5}}]}))
    out = tmp_path / "merged"
    result = CliRunner().invoke(main, ["merge", "--no-progress", "--cache-dir",
                                       str(tmp_path / "cache"), "--gguf", "q8_0",
                                       str(recipe), str(out)])
    assert result.exit_code == 0, result.output
    assert "dequantized to be merged, which is lossy" in result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    entry = next(f for f in manifest["files"] if f["path"] == "model-q8_0.gguf")
    assert entry["size"] == (out / "model-q8_0.gguf").stat().st_size
    assert manifest["gguf"]["type"] == "q8_0"
    assert manifest["gguf_inputs"][str(tiny["gguf"])]["quantization"] == "Q8_0"
    reader = gguf.GGUFReader(out / "model-q8_0.gguf")
    assert reader.get_field("tokenizer.chat_template").contents() == CHAT_TEMPLATE
    assert reader.get_field("tokenizer.ggml.model").contents() == "gpt2"
    assert len(reader.get_field("tokenizer.ggml.tokens").contents()) == 264
    assert json.loads(reader.get_field("maec.recipe").contents())["merge_method"] == \
        "task_arithmetic"
    sources = json.loads(reader.get_field("maec.gguf_sources").contents())
    assert sources == manifest["gguf_inputs"]
    inputs = json.loads(reader.get_field("maec.inputs").contents())
    assert all(e["files"] for e in inputs.values())


def test_cli_refuses_an_unwritten_type_before_merging(tiny: dict[str, Path],
                                                      tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"merge_method": "linear", "models": [
        {"model": str(tiny["base"]), "parameters": {"weight": 1.0}}]}))
    result = CliRunner().invoke(main, ["merge", "--no-progress", "--gguf", "q4_k_m",
                                       str(recipe), str(tmp_path / "out")])
    assert result.exit_code == 2 and "unsupported_gguf_output" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_f32_gguf_loads_back_exactly(tiny: dict[str, Path], tmp_path: Path, arch: str
                                     ) -> None:
    # f32 loses nothing, so any difference is a wrong name, layout or q/k permutation.
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from maec_core.gguf.writer import write_gguf
    from tests.gguf_factory import bpe_tokenizer

    folder = tiny["base"]
    if arch == "qwen2":
        folder = tmp_path / "qwen2"
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(
            vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.1)  # zero biases would hide a dropped one
        model.save_pretrained(folder)
        bpe_tokenizer().save_pretrained(folder)  # type: ignore[attr-defined]
    write_gguf(folder, tmp_path / "m.gguf", "f32")
    back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf",
                                                dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 77, 200, 3, 259]])
    with torch.no_grad():
        assert torch.allclose(back(ids).logits, ref(ids).logits, atol=1e-5)
