"""Tiny GGUF files for tests: a seeded tiny Llama with a byte-level BPE tokenizer (the
tokenizer kind GGUF's gpt2 model holds), written by the project's own GGUF writer, and
hand-made bad files (truncated, foreign architecture, unreadable tensor type)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from tests.factories import make_llama

# 256 byte tokens, a few merges, three specials: 264 rows, a multiple of q8_0's block.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                 "assistant\n{% endif %}")


def bpe_tokenizer() -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", unk_token="<|unk|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_hf(path: Path, seed: int = 0, like: Path | None = None) -> Path:
    """A tiny Llama folder with the BPE tokenizer (264 rows: 256 bytes, 4 merges, 3
    specials, 1 spare)."""
    make_llama(path, seed=seed, like=like, tokenizer=False, vocab_size=264,
               bos_token_id=256 + 4, eos_token_id=256 + 5)
    bpe_tokenizer().save_pretrained(path)  # type: ignore[attr-defined]
    return path


def tiny_gguf(folder: Path, dest: Path, qtype: str = "q8_0") -> Path:
    from maec_core.gguf.writer import write_gguf

    write_gguf(folder, dest, qtype, provenance={"recipe": "{}", "inputs": "{}"})
    return dest


def foreign_gguf(dest: Path, arch: str = "bert",
                 qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32) -> Path:
    """A well-formed GGUF file of ``arch`` with one tensor of ``qtype`` (raw bytes)."""
    w = gguf.GGUFWriter(dest, arch)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    w.add_tensor("token_embd.weight", np.zeros((4, 64 // block * size), np.uint8),
                 raw_dtype=qtype) if qtype != gguf.GGMLQuantizationType.F32 else \
        w.add_tensor("token_embd.weight", np.zeros((4, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def sparse_gguf(dest: Path, elements: int) -> Path:
    """A llama GGUF whose header declares one F32 tensor of ``elements`` weights, its data
    a hole in a sparse file: a big model's header at no disk cost."""
    w = gguf.GGUFWriter(dest, "llama")
    w.add_tensor_info("token_embd.weight", (elements // 1024, 1024), np.dtype(np.float32),
                      elements * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with open(dest, "r+b") as f:
        f.truncate(f.seek(0, 2) + elements * 4 + 64)
    return dest
