"""Router weights: one row per expert and layer, from the gate mode.

The arithmetic is mergekit-moe 0.1.5's, step for step and in its dtypes, so the
deterministic modes give its bits: ``hidden`` runs the base model in bfloat16 on the
prompts (transformers, CPU) and takes each layer's input hidden state at the last token
(``hidden_avg``: the mean over tokens), averaged over the prompts; ``cheap_embed`` sums
the prompts' token embeddings in float32 and normalises them, one vector for every
layer. Negative prompts' vectors are subtracted, and each expert's vector is normalised
to unit length per layer. The random modes draw from a generator seeded by the config's
``random_seed`` (mergekit's are unseeded).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from maec_core.errors import CheckpointError, RecipeError, TokenizerError
from maec_core.io.folder import ModelFolder
from maec_core.io.reader import TensorReader
from maec_core.moe.config import Expert, MoeConfig

if TYPE_CHECKING:
    from collections.abc import Callable

EMBED = "model.embed_tokens.weight"


def gated_experts(config: MoeConfig) -> list[Expert]:
    """The experts that get router rows, in order: every routed expert, then the shared
    ones when they have prompts or the gate is random (mergekit's rule)."""
    shared = config.shared_experts or []
    prompted = any(e.positive_prompts for e in shared)
    if shared and any(bool(e.positive_prompts) != prompted for e in shared):
        raise RecipeError("give prompts for every shared expert or for none",
                          key="shared_experts")
    if shared and (prompted or config.gate_mode in ("random", "uniform_random")):
        return [*config.experts, *shared]
    return list(config.experts)


def load_tokenizer(base: ModelFolder) -> Any:
    """The base's tokenizer from its folder (never remote code), padded on the left with
    its BOS (else EOS) token, as mergekit-moe pads the prompts."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(base.root), trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TokenizerError(f"{base.root.name}: the base's tokenizer cannot be loaded "
                             f"({type(exc).__name__}: {exc})") from None
    tok.padding_side = "left"
    tok.pad_token_id = tok.bos_token_id
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _tokenize(tok: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
    try:
        batch = tok([(tok.bos_token or "") + p for p in prompts], return_tensors="pt",
                    padding=True, add_special_tokens=False)
    except (ValueError, TypeError) as exc:
        raise RecipeError(f"the prompts cannot be tokenized: {exc}", key="prompts") from None
    if batch["input_ids"].shape[-1] == 0:
        raise RecipeError("a prompt set tokenizes to no tokens", key="prompts")
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def _cheap_embed(embed: torch.Tensor, layers: int) -> Callable[[dict[str, torch.Tensor]],
                                                               torch.Tensor]:
    table = embed.float()

    def vector(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = batch["input_ids"]
        if int(ids.max()) >= table.shape[0]:
            raise TokenizerError("the tokenizer gives ids beyond the embedding's rows")
        # A row lookup, which is exactly the one-hot product mergekit computes (each
        # sum has one non-zero term).
        h = table[ids]
        summed = (h * batch["attention_mask"].unsqueeze(-1)).sum(dim=1).sum(dim=0,
                                                                             keepdim=True)
        unit = summed / summed.norm(dim=-1, keepdim=True).clamp(min=1e-8)
        repeated: torch.Tensor = unit.repeat(layers, 1)
        return repeated

    return vector


def _hidden(base: ModelFolder, average: bool) -> Callable[[dict[str, torch.Tensor]],
                                                          torch.Tensor]:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(base.root), dtype=torch.bfloat16, device_map="cpu", low_cpu_mem_usage=True,
            use_safetensors=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"{base.root.name}: the base cannot be loaded to compute "
                              f"hidden states ({type(exc).__name__}: {exc})") from None
    model.train(False)

    def vector(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            out = model(**batch, output_hidden_states=True, return_dict=True)
        # Each layer's input: the embedding output and every layer's but the last.
        states = torch.stack(out.hidden_states[:-1])  # (layers, batch, seq, hidden)
        states = states.sum(dim=2) / states.shape[2] if average else states[:, :, -1, :]
        return states.sum(dim=1) / states.shape[1]

    return vector


def _random(config: MoeConfig, layers: int, n: int, hidden: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(config.random_seed)
    if config.gate_mode == "random":
        return torch.randn((layers, n, hidden), generator=gen)
    scale = math.sqrt(1.0 / hidden)
    return torch.rand((layers, n, hidden), generator=gen) * 2 * scale - scale


def gate_vectors(config: MoeConfig, base: ModelFolder, layers: int,
                 hidden: int) -> torch.Tensor:
    """Router rows, ``(layers, gated experts, hidden)`` (see :func:`gated_experts`)."""
    experts = gated_experts(config)
    if config.gate_mode in ("random", "uniform_random"):
        return _random(config, layers, len(experts), hidden)
    tok = load_tokenizer(base)
    if config.gate_mode == "cheap_embed":
        with TensorReader() as reader:
            embed = reader.read(base.tensors[EMBED])
        vector = _cheap_embed(embed, layers)
    else:
        vector = _hidden(base, average=config.gate_mode == "hidden_avg")
    rows = []
    for e in experts:
        v = vector(_tokenize(tok, list(e.positive_prompts or [])))
        if e.negative_prompts:
            v -= vector(_tokenize(tok, list(e.negative_prompts)))
        v /= v.norm(p=2, dim=-1, keepdim=True).clamp(min=1e-8)
        rows.append(v)
    return torch.stack(rows, dim=0).permute(1, 0, 2)
