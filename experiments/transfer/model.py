"""The tiny Llama, its word-level tokenizer, training, saving and diagnostics.

Accuracy and perplexity are measured by the project's evaluation library
(``maec_core.eval``) on eval-set files, see ``experiments.transfer.evalsets``."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from tokenizers.processors import TemplateProcessing
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from experiments.transfer import lang
from experiments.transfer.lang import BOS, EOS, PAD, UNK, Sampler


@dataclass(frozen=True)
class ModelSize:
    hidden: int = 192
    layers: int = 4
    heads: int = 4
    intermediate: int = 512
    max_len: int = 64


class Vocab:
    """Token <-> id, fixed by lang.vocabulary() (or the extended vocabulary)."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self.tokens = list(tokens)
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.pad = self.ids[PAD]
        self.bos = self.ids[BOS]
        self.eos = self.ids[EOS]

    def encode(self, toks: Sequence[str]) -> list[int]:
        return [self.ids[t] for t in toks]

    def __len__(self) -> int:
        return len(self.tokens)


VOCAB = Vocab(lang.vocabulary())
# θ0's vocabulary with T'x's word forms appended: the extended language base's only.
# Every existing token keeps its id, so special tokens and θ0's rows line up.
XVOCAB = Vocab(lang.extended_vocabulary())


def hf_tokenizer(vocab: Vocab = VOCAB) -> PreTrainedTokenizerFast:
    """A complete HF tokenizer so each saved checkpoint is a self-contained model folder
    (the engine's gradient importance tokenises the ability corpus with it). Text is
    whitespace-separated tokens; BOS is prepended exactly as in training."""
    tok = Tokenizer(WordLevel(vocab=dict(vocab.ids), unk_token=UNK))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.post_processor = TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab.bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK
    )


def new_model(size: ModelSize, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.heads,
        max_position_embeddings=size.max_len,
        tie_word_embeddings=False,
        pad_token_id=VOCAB.pad,
        bos_token_id=VOCAB.bos,
        eos_token_id=VOCAB.eos,
        rms_norm_eps=1e-5,
    )
    model = LlamaForCausalLM(cfg)
    model.float()
    return model


def save(model: LlamaForCausalLM, path: Path, info: dict[str, object],
         vocab: Vocab = VOCAB) -> None:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    hf_tokenizer(vocab).save_pretrained(str(path))
    (path / "training.json").write_text(json.dumps(info, indent=1, sort_keys=True))


def load(path: Path) -> LlamaForCausalLM:
    model = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    return model


def is_complete(path: Path) -> bool:
    return (path / "model.safetensors").exists() and (path / "training.json").exists()


# ---------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainSpec:
    steps: int
    lr: float
    batch: int = 32
    warmup: int = 50
    weight_decay: float = 0.0
    # Parameter-name substrings kept fixed; fine-tunes freeze embeddings and lm_head so
    # that what the donor learns lives in the transformer layers, where MAEC operates.
    freeze: tuple[str, ...] = ()
    # Supervised fine-tuning on the completion only: the loss sees the answer and EOS, the
    # last two tokens of every example (the ability's items have single-token answers).
    answer_only: bool = False
    # Rows of the frozen embedding and LM head from this id on are trained all the same:
    # the extended language base learns its new tokens' rows and leaves θ0's as they are.
    train_rows_from: int | None = None

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        # Unset, it is left out, so the cache keys of every earlier stage stay the same.
        if d["train_rows_from"] is None:
            del d["train_rows_from"]
        return d


def batch_tensors(seqs: Sequence[Sequence[int]], max_len: int) -> tuple[torch.Tensor, ...]:
    n = min(max_len, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), n), VOCAB.pad, dtype=torch.long)
    att = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        s = s[:n]
        ids[i, : len(s)] = torch.tensor(s)
        att[i, : len(s)] = 1
    labels = ids.masked_fill(att == 0, -100)
    return ids, att, labels


def example_ids(toks: Sequence[str], vocab: Vocab = VOCAB) -> list[int]:
    return [vocab.bos, *vocab.encode(toks), vocab.eos]


def train(model: LlamaForCausalLM, sampler: Sampler, spec: TrainSpec, seed: int,
          max_len: int, progress: Callable[[int, float], None] | None = None,
          vocab: Vocab = VOCAB) -> list[float]:
    """AdamW with linear warmup and cosine decay; batches drawn fresh from the sampler
    with a seeded RNG, so a (sampler, spec, seed) triple is reproducible."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    params = []
    hooks = []
    for name, p in model.named_parameters():
        frozen = any(f in name for f in spec.freeze)
        if frozen and spec.train_rows_from is not None and p.dim() == 2:
            # Only the new rows learn: the old rows' gradient is zeroed, and AdamW with no
            # weight decay leaves a parameter whose gradient was always zero unchanged.
            start = spec.train_rows_from
            hooks.append(p.register_hook(lambda g, start=start: torch.cat(
                [torch.zeros_like(g[:start]), g[start:]])))
            frozen = False
        p.requires_grad_(not frozen)
        if not frozen:
            params.append(p)
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay,
                            betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < spec.warmup:
            return (step + 1) / spec.warmup
        frac = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    losses: list[float] = []
    for _ in range(spec.steps):
        seqs = [example_ids(sampler(rng), vocab) for _ in range(spec.batch)]
        ids, att, labels = batch_tensors(seqs, max_len)
        if spec.answer_only:
            keep = torch.zeros_like(att)
            ends = att.sum(dim=1)
            for i, n in enumerate(ends.tolist()):
                keep[i, n - 2: n] = 1
            labels = labels.masked_fill(keep == 0, -100)
        out = model(input_ids=ids, attention_mask=att, labels=labels)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(float(out.loss.detach()))
        if progress is not None and (len(losses) % 500 == 0):
            progress(len(losses), sum(losses[-100:]) / len(losses[-100:]))
    model.eval()
    for h in hooks:
        h.remove()
    for p in model.parameters():
        p.requires_grad_(True)
    return losses


# ---------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------


@torch.no_grad()
def copy_rows(model: LlamaForCausalLM, pairs: Sequence[tuple[str, str]],
              vocab: Vocab = VOCAB) -> None:
    """Start each ``(new, old)`` token's embedding and LM-head rows as copies of ``old``'s:
    how a vocabulary is extended in practice (WECHSEL-style initialisation), so the new
    words begin where their counterparts are and training moves them from there."""
    emb = model.model.embed_tokens.weight
    head = model.lm_head.weight
    for new, old in pairs:
        emb[vocab.ids[new]] = emb[vocab.ids[old]]
        head[vocab.ids[new]] = head[vocab.ids[old]]


def extend_vocabulary(model: LlamaForCausalLM, vocab: Vocab,
                      pairs: Sequence[tuple[str, str]]) -> LlamaForCausalLM:
    """``model`` with embedding and LM-head rows for ``vocab``'s appended tokens, each
    ``(new, old)`` new row starting as a copy of ``old``'s (every appended token must be
    in ``pairs``; the resize's own initialisation is overwritten, so nothing random
    remains)."""
    old_rows = int(model.model.embed_tokens.weight.shape[0])
    model.resize_token_embeddings(len(vocab), mean_resizing=False)
    new = {vocab.ids[n] for n, _ in pairs}
    assert new == set(range(old_rows, len(vocab))), "every appended row needs a source"
    copy_rows(model, pairs, vocab)
    return model


@torch.no_grad()
def hidden_alignment(model: LlamaForCausalLM, pairs: Iterable[tuple[list[str], list[str]]]
                     ) -> dict[str, list[float]]:
    """Per layer (0 = embeddings): mean cosine of mean-pooled hidden states of parallel S/T
    sentences, and the same for mismatched S/T pairs (the baseline that separates shared
    meaning from shared 'being a sentence')."""
    pairs = list(pairs)
    s_seqs = [example_ids(s)[:-1] for s, _ in pairs]
    t_seqs = [example_ids(t)[:-1] for _, t in pairs]

    def pooled(seqs: list[list[int]]) -> list[torch.Tensor]:
        ids, att, _ = batch_tensors(seqs, 10_000)
        out = model(input_ids=ids, attention_mask=att, output_hidden_states=True)
        # Drop the BOS position (identical in both languages) from the pooling.
        mask = att.clone()
        mask[:, 0] = 0
        m = mask.unsqueeze(-1).float()
        return [(h * m).sum(1) / m.sum(1) for h in out.hidden_states]

    hs, ht = pooled(s_seqs), pooled(t_seqs)
    parallel, mismatched = [], []
    for a, b in zip(hs, ht, strict=True):
        parallel.append(float(torch.nn.functional.cosine_similarity(a, b).mean()))
        mismatched.append(float(torch.nn.functional.cosine_similarity(
            a, b.roll(1, dims=0)).mean()))
    centred = []
    for a, b in zip(hs, ht, strict=True):
        # Centring each language removes the per-language mean direction, so what remains
        # is whether *which sentence* it is lines up across languages.
        ac = a - a.mean(0, keepdim=True)
        bc = b - b.mean(0, keepdim=True)
        centred.append(float(torch.nn.functional.cosine_similarity(ac, bc).mean()))
    return {"parallel": parallel, "mismatched": mismatched, "centred_parallel": centred}
