"""GGUF out on the real model: the file loads back in transformers' GGUF loader with the
tokenizer and chat template intact, and its logits stay within the bounds docs/gguf.md
states (f16 tight, q8_0 bounded)."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from maec_core.gguf.writer import write_gguf
from tests import real_model

# docs/gguf.md quotes these. f16: the bf16 weights fit f16 but for tiny values;
# q8_0: 8 bits per weight with a scale per 32.
BOUNDS = {"f16": 0.1, "q8_0": 2.0}


@pytest.fixture(scope="module")
def base() -> Path:
    # The base alone: the family's siblings are not needed here.
    reason = real_model.available()
    if reason:
        pytest.skip(reason)
    return real_model.real_base()


@pytest.fixture(scope="module")
def reference(base: Path) -> tuple[object, torch.Tensor, torch.Tensor]:
    model, tok = real_model.load(base)
    ids = tok(real_model.chat_prompt(tok) + real_model.ANSWER_PREFIX, return_tensors="pt",
              add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        return tok, ids, model(ids).logits[0]


@pytest.mark.parametrize("qtype", ["f16", "q8_0"])
def test_gguf_loads_back_within_bounds(base: Path, reference: tuple[
        object, torch.Tensor, torch.Tensor], tmp_path: Path, qtype: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, ids, want = reference
    dest = tmp_path / f"m-{qtype}.gguf"
    write_gguf(base, dest, qtype, provenance={"recipe": "{}", "inputs": "{}"})
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=dest.name,
                                                 dtype=torch.float32)
    with torch.no_grad():
        got = model(ids).logits[0]
    assert (got - want).abs().max().item() < BOUNDS[qtype]
    # The answer's token is the same; over the whole prompt, near ties may swap (q8_0).
    assert got[-1].argmax() == want[-1].argmax()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= (1.0 if qtype == "f16" else 0.9)
    back = AutoTokenizer.from_pretrained(tmp_path, gguf_file=dest.name)
    assert back.chat_template == tok.chat_template  # type: ignore[attr-defined]
    prompt = real_model.chat_prompt(tok)
    assert back(prompt)["input_ids"] == tok(prompt)["input_ids"]  # type: ignore[operator]
    reader = gguf.GGUFReader(dest)
    assert reader.get_field("general.architecture").contents() == "llama"
    assert len(reader.get_field("tokenizer.ggml.merges").contents()) > 40000
    assert reader.get_field("maec.recipe").contents() == "{}"
