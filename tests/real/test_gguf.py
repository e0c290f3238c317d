"""GGUF out on the real model: the file loads back in transformers' GGUF loader with the
tokenizer and chat template intact, and its logits stay within the bounds docs/gguf.md
states (f16 tight, q8_0 bounded)."""

from __future__ import annotations

from typing import Any

import gguf
import pytest
import torch

from maec_core.gguf.writer import write_gguf
from tests import real_model

pytestmark = pytest.mark.slow

# docs/gguf.md quotes these (and what was measured). f16: bfloat16 weights fit float16
# but for tiny values; q8_0: 8 bits a weight with a scale per 32.
BOUNDS = {"f16": 0.1, "q8_0": 2.0}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The real model's folder (the family's base alone), its logits on a chat prompt,
    and both GGUF files written from it."""
    reason = real_model.available()
    if reason:
        pytest.skip(reason)
    base = real_model.real_base()
    model, tok = real_model.load(base)
    ids = tok(real_model.chat_prompt(tok) + real_model.ANSWER_PREFIX, return_tensors="pt",
              add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        want = model(ids).logits[0]
    out = tmp_path_factory.mktemp("gguf-out")
    for qtype in BOUNDS:
        write_gguf(base, out / f"m-{qtype}.gguf", qtype,
                   provenance={"recipe": "{}", "inputs": "{}"})
    return {"tok": tok, "ids": ids, "want": want, "dir": out}


@pytest.mark.parametrize("qtype", list(BOUNDS))
def test_gguf_logits_within_bounds(written: dict[str, Any], qtype: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(written["dir"], gguf_file=f"m-{qtype}.gguf",
                                                 dtype=torch.float32)
    with torch.no_grad():
        got = model(written["ids"]).logits[0]
    want = written["want"]
    assert (got - want).abs().max().item() < BOUNDS[qtype]
    # The answer's token is the same; over the whole prompt, near ties may swap (q8_0).
    assert got[-1].argmax() == want[-1].argmax()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= (1.0 if qtype == "f16" else 0.9)


def test_gguf_tokenizer_and_metadata_intact(written: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    tok = written["tok"]
    back = AutoTokenizer.from_pretrained(written["dir"], gguf_file="m-q8_0.gguf")
    assert back.chat_template == tok.chat_template
    prompt = real_model.chat_prompt(tok)
    assert back(prompt)["input_ids"] == tok(prompt)["input_ids"]
    reader = gguf.GGUFReader(written["dir"] / "m-q8_0.gguf")
    assert reader.get_field("general.architecture").contents() == "llama"
    assert reader.get_field("general.file_type").contents() == gguf.LlamaFileType.MOSTLY_Q8_0
    assert len(reader.get_field("tokenizer.ggml.merges").contents()) > 40000
    assert reader.get_field("maec.recipe").contents() == "{}"
