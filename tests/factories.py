"""Tiny seeded Llama checkpoints built locally (never downloaded)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def make_llama(
    path: Path,
    seed: int,
    *,
    dtype: torch.dtype = torch.float32,
    like: Path | None = None,
    noise: float = 0.02,
    tokenizer: bool = True,
    max_shard_size: str | None = None,
    **overrides: int | bool,
) -> Path:
    """Save a seeded tiny Llama at ``path``.

    With ``like``, the weights are those of the checkpoint at ``like`` plus seeded
    Gaussian noise of scale ``noise`` (a "fine-tune" of a common ancestor).
    """
    cfg = LlamaConfig(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    if like is not None:
        parent = LlamaForCausalLM.from_pretrained(like, dtype=torch.float32)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for (_name, p), (_, q) in zip(
                model.named_parameters(), parent.named_parameters(), strict=True
            ):
                p.copy_(q + noise * torch.randn(q.shape, generator=gen))
    model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if tokenizer:
        tiny_tokenizer().save_pretrained(path)
    return path


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def run_recipe(source: object, out: Path | str, **kwargs: object) -> object:
    """Parse ``source`` (a dict, YAML text or path) and merge it through the one entry,
    in the run context ``kwargs`` make (``device="cpu"``, ...)."""
    from maec_core.context import RunContext
    from maec_core.parsing import parse_recipe
    from maec_core.run import run

    return run(parse_recipe(source), Path(out), RunContext(**kwargs))  # type: ignore[arg-type]

def bos_tokenizer(vocab: dict[str, int]) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over ``vocab`` (which holds ``<unk>``, ``<s>`` as
    id 1, ``</s>`` and ``<pad>``) that puts a BOS before every text, as Llama tokenizers
    do."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")


def extended_tokenizer(words: list[str], added: list[str] = ()) -> PreTrainedTokenizerFast:
    """The tiny tokenizer with ``words`` appended to its model vocabulary (a language
    base's extension) and ``added`` as added (non-model) tokens after them."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    vocab.update({w: len(vocab) + i for i, w in enumerate(words)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    if added:
        fast.add_tokens(list(added))
    return fast


def make_extended(
    path: Path, seed: int, *, like: Path, words: list[str], added: list[str] = (),
    noise: float = 0.02, drop: int = 0,
) -> Path:
    """A checkpoint whose tokenizer extends ``like``'s: ``like``'s weights plus noise,
    with new seeded rows for the new tokens (embedding and LM head). ``drop`` removes
    that many of ``like``'s last plain tokens first (a vocabulary that also lost some)."""
    parent = LlamaForCausalLM.from_pretrained(like, dtype=torch.float32)
    tok = extended_tokenizer(words, added)
    if drop:
        data = json.loads(tok.backend_tokenizer.to_str())
        model_vocab = data["model"]["vocab"]
        gone = [f"w{60 - i}" for i in range(drop)]
        kept = [t for t in sorted(model_vocab, key=model_vocab.get) if t not in gone]
        data["model"]["vocab"] = {t: i for i, t in enumerate(kept)}
        for i, entry in enumerate(data["added_tokens"]):
            if entry["content"] not in model_vocab:
                entry["id"] = len(kept) + i - sum(1 for e in data["added_tokens"][:i]
                                                  if e["content"] in model_vocab)
        from tokenizers import Tokenizer

        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)),
                                      unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    old = {t: i for t, i in tiny_tokenizer().get_vocab().items()}
    new_vocab = tok.get_vocab()
    n = len(new_vocab)
    cfg = LlamaConfig(**{**TINY, "vocab_size": n,
                         "tie_word_embeddings": parent.config.tie_word_embeddings})
    model = LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        src = dict(parent.named_parameters())
        for name, p in model.named_parameters():
            q = src[name]
            if q.shape == p.shape:
                p.copy_(q + noise * torch.randn(q.shape, generator=gen))
                continue
            fresh = 0.02 * torch.randn(p.shape, generator=gen)
            for t, i in new_vocab.items():
                if t in old:
                    fresh[i] = q[old[t]] + noise * torch.randn(q.shape[1:], generator=gen)
            p.copy_(fresh)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def spy_slice_sizes(monkeypatch: Any, method: str, unit: int, chunk: int) -> list[int]:
    """Make the engine stream units of ``unit`` and slices of ``chunk`` entries (odd sizes
    cut every tensor at odd places) and record, per call of ``method``'s tensor function,
    the largest input it was given (its compiled ``merge_into`` too): a method that
    streams never sees more than ``chunk``."""
    import maec_core.streaming as streaming
    from maec_core.methods import get_method

    monkeypatch.setattr(streaming, "UNIT_CPU", unit)
    monkeypatch.setattr(streaming, "CHUNK_CPU", chunk)
    spec = type(get_method(method))
    merge = spec.merge
    sizes: list[int] = []

    def spied(self: Any, call: Any) -> torch.Tensor:
        sizes.append(max(t.numel() for t in call.models))
        return merge(self, call)

    monkeypatch.setattr(spec, "merge", spied)
    fused = spec.merge_into

    def spied_into(self: Any, call: Any, out: Any, compute: Any) -> Any:
        sizes.append(max(t.numel() for t in call.models))
        return fused(self, call, out, compute)

    # A compiled fast path is called per slice instead of merge, when it takes them.
    monkeypatch.setattr(spec, "merge_into", spied_into)
    kernel = spec.kernel

    def spied_kernel(self: Any, call: Any, compute: str) -> Any:
        chosen = kernel(self, call, compute)
        if chosen is None:
            return None

        def spied_run(inputs: Any, out: Any) -> Any:
            if out.numel:  # not the empty call that asks whether it takes them
                sizes.append(max(f.numel for f in inputs))
            return chosen(inputs, out)

        return spied_run

    # A merge whose every tensor has a kernel runs it per slice, without torch.
    monkeypatch.setattr(spec, "kernel", spied_kernel)
    return sizes
