"""Tiny local checkpoints of every architecture mergekit's own recipes and tests use.

Each family has a base and two or three "fine-tunes" (the base plus seeded noise), so
recipes that need a common ancestor (task arithmetic, TIES, ...) have one. The tokenizer
fixtures mirror the vocabularies mergekit's tokenizer tests build: a base of 64 tokens,
one that adds the two ChatML tokens (66 rows), and one whose tokenizer adds four unused
tokens beyond its 64 embedding rows.

Nothing is downloaded: every config is written here and the weights are seeded.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerFast

from tests.factories import tiny_tokenizer

LAYERS = 6
_SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _config(arch: str) -> PretrainedConfig:
    """A tiny config of ``arch`` (six layers, 32 wide, 64 tokens)."""
    import transformers as tf

    if arch == "gpt2":
        return tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=LAYERS, n_head=4,
                             n_positions=64, bos_token_id=1, eos_token_id=2)
    if arch == "phi":
        return tf.PhiConfig(**{**_SHAPE, "num_key_value_heads": 4})
    if arch == "gemma":
        return tf.GemmaConfig(**_SHAPE, head_dim=8)
    if arch == "phi3":
        return tf.Phi3Config(**_SHAPE, tie_word_embeddings=False, pad_token_id=0)
    if arch == "mistral3":
        # A Llava-style VLM: a Mistral language model, a Pixtral vision tower (two
        # blocks) and the projector between them.
        return tf.Mistral3Config(
            text_config={**_SHAPE, "model_type": "mistral", "head_dim": 8},
            vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32,
                               num_hidden_layers=2, num_attention_heads=2, head_dim=8,
                               image_size=32, patch_size=8),
            spatial_merge_size=2)
    builders: dict[str, Callable[..., PretrainedConfig]] = {
        "llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config,
        "granite": tf.GraniteConfig,
    }
    return builders[arch](**_SHAPE, tie_word_embeddings=False)


ARCHITECTURES = ("llama", "mistral", "qwen2", "gemma", "phi", "phi3", "gpt2", "granite",
                 "mistral3")


def model_class(config: PretrainedConfig) -> Any:
    """The transformers auto class that builds and loads ``config``'s model."""
    from transformers import AutoModelForImageTextToText

    vision = getattr(config, "vision_config", None) is not None
    return AutoModelForImageTextToText if vision else AutoModelForCausalLM


def make_model(path: Path, arch: str, seed: int, like: Path | None = None,
               noise: float = 0.02) -> Path:
    """A seeded tiny ``arch`` checkpoint (float32, safetensors) with a tokenizer at
    ``path``; with ``like``, that checkpoint's weights plus noise of scale ``noise``."""
    torch.manual_seed(seed)
    config = _config(arch)
    auto = model_class(config)
    model = auto.from_config(config)
    if like is not None:
        parent = auto.from_pretrained(like, dtype=torch.float32)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p, q in zip(model.parameters(), parent.parameters(), strict=True):
                p.copy_(q + noise * torch.randn(q.shape, generator=gen))
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def vocab_tokenizer(size: int, added: list[str]) -> PreTrainedTokenizerFast:
    """A BPE tokenizer of ``size`` base tokens (``<unk> <s> </s> _tok_3 ...``) without
    merges, plus ``added`` tokens: the vocabularies of mergekit's tokenizer tests."""
    from tokenizers import Tokenizer, models

    names = ["<unk>", "<s>", "</s>", *(f"_tok_{i}" for i in range(3, size))][:size]
    tok = Tokenizer(models.BPE(vocab={n: i for i, n in enumerate(names)}, merges=[],
                               unk_token="<unk>"))
    with tempfile.TemporaryDirectory() as tmp:
        tok.save(str(Path(tmp) / "tokenizer.json"))
        out = PreTrainedTokenizerFast(tokenizer_file=str(Path(tmp) / "tokenizer.json"),
                                      unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    out.add_tokens(added)
    return out


def make_vocab_model(path: Path, seed: int, rows: int, added: list[str]) -> Path:
    """A tiny Llama of ``rows`` embedding rows with a :func:`vocab_tokenizer`."""
    cfg = _config("llama")
    cfg.vocab_size = rows
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    vocab_tokenizer(64, added).save_pretrained(path)
    return path


def _lora_adapter(path: Path, base: Path, seed: int) -> Path:
    """A PEFT LoRA adapter (rank 4, attention projections) for the Llama at ``base``."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    cfg = json.loads((base / "config.json").read_text())
    hidden, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    outs = {"q_proj": hidden, "k_proj": hidden // heads * kv, "v_proj": hidden // heads * kv,
            "o_proj": hidden}
    tensors: dict[str, torch.Tensor] = {}
    for i in range(cfg["num_hidden_layers"]):
        for mod, width in outs.items():
            stem = f"base_model.model.model.layers.{i}.self_attn.{mod}"
            tensors[f"{stem}.lora_A.weight"] = 0.1 * torch.randn(4, hidden, generator=gen)
            tensors[f"{stem}.lora_B.weight"] = 0.1 * torch.randn(width, 4, generator=gen)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "base_model_name_or_path": str(base),
        "target_modules": list(outs), "task_type": "CAUSAL_LM", "bias": "none",
        "fan_in_fan_out": False, "lora_dropout": 0.0}))
    return path


class ModelFarm:
    """The checkpoints recipes name, built on first use under ``root``.

    Placeholders: ``base a b c`` are Llama (a, b, c fine-tunes of base); ``<arch>_base``,
    ``<arch>_a``, ``<arch>_b`` for the other architectures; ``tok_base``, ``tok_chatml``,
    ``tok_padded`` the tokenizer fixtures; ``lora_a`` a LoRA adapter of ``base``.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._built: dict[str, Path] = {}

    def __getitem__(self, key: str) -> Path:
        if key not in self._built:
            self._built[key] = self._build(key)
        return self._built[key]

    def _build(self, key: str) -> Path:
        where = self.root / key
        toks: dict[str, tuple[int, int, list[str]]] = {
            "tok_base": (10, 64, []),
            "tok_chatml": (11, 66, ["<|im_start|>", "<|im_end|>"]),
            "tok_padded": (12, 64, [f"<UNUSED_{i}>" for i in range(4)]),
        }
        if key in toks:
            seed, rows, added = toks[key]
            return make_vocab_model(where, seed, rows, added)
        if key == "lora_a":
            return _lora_adapter(where, self["base"], seed=21)
        arch, _, role = key.rpartition("_")
        if not arch:
            arch, role = "llama", key
        if role == "base":
            return make_model(where, arch, seed=ARCHITECTURES.index(arch) * 10)
        parent = self["base" if arch == "llama" else f"{arch}_base"]
        seed = ARCHITECTURES.index(arch) * 10 + " abc".index(role)
        return make_model(where, arch, seed=seed, like=parent)

    def mapping(self, keys: list[str]) -> dict[str, Any]:
        return {k: str(self[k]) for k in keys}
