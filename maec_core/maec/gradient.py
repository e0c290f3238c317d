"""``importance: gradient``: accumulate ∂loss/∂θ at θ0 over the ability corpus.

The causal-LM loss of θ0 on the ability corpus, in file order, cut into ``seq_len``
token blocks, ``batch_size`` blocks per batch, until ``token_budget`` tokens; the
per-batch gradients are summed (``G = Σ_batches ∂loss/∂θ``) in float32. Only the
included tensors get gradients, so memory is the model, its activations, and one float32
accumulator per included tensor. This is the one MAEC stage that holds a whole model:
it is a GPU job at real sizes.

The model and tokenizer come from θ0's own folder (never a hub, never remote code).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from maec_core.errors import Cancelled, CheckpointError, CorpusError
from maec_core.io.folder import ModelFolder
from maec_core.maec.params import MaecParams

JSONL_SUFFIXES = (".jsonl", ".ndjson")


def corpus_texts(path: str | Path) -> Iterator[str]:
    """Documents of a JSONL (``{"text": ...}`` per line) or plain-text corpus, in order.

    Plain text is split into paragraphs at blank lines.
    """
    p = Path(path)
    if not p.is_file():
        raise CorpusError(f"ability corpus not found: {p}", path=str(p))
    try:
        with open(p, encoding="utf-8") as f:
            if p.suffix.lower() in JSONL_SUFFIXES:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        doc = json.loads(line)
                    except json.JSONDecodeError:
                        raise CorpusError(
                            f"{p.name} line {n} is not JSON (expected {{\"text\": ...}})",
                            path=str(p), line=n,
                        ) from None
                    if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
                        raise CorpusError(
                            f"{p.name} line {n} has no string field \"text\"",
                            path=str(p), line=n,
                        )
                    if doc["text"].strip():
                        yield doc["text"]
            else:
                para: list[str] = []
                for line in f:
                    if line.strip():
                        para.append(line)
                    elif para:
                        yield "".join(para)
                        para = []
                if para:
                    yield "".join(para)
    except UnicodeDecodeError:
        raise CorpusError(f"ability corpus {p.name} is not UTF-8 text", path=str(p)) from None


def corpus_tokens(path: str | Path, tokenizer: Any, budget: int) -> list[int]:
    """The first ``budget`` tokens of the corpus, documents joined by EOS."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for text in corpus_texts(path):
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if eos is not None:
            ids.append(int(eos))
        if len(ids) >= budget:
            break
    ids = ids[:budget]
    if len(ids) < 2:
        raise CorpusError(
            f"ability corpus {Path(path).name} has no usable text (fewer than 2 tokens after "
            "tokenization)",
            path=str(path), tokens=len(ids),
        )
    return ids


def _load(base: ModelFolder, device: torch.device) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(base.root), local_files_only=True, trust_remote_code=False
        )
    except Exception as exc:  # transformers raises many types for a missing tokenizer
        raise CheckpointError(
            f"importance: gradient needs θ0's tokenizer, and {base.root} has none usable: "
            f"{exc}",
            path=str(base.root),
        ) from None
    # float32 on CPU (bf16 CPU matmuls are slow and inexact); the stored dtype on a GPU,
    # with the accumulation itself in float32.
    dtype = torch.float32 if device.type == "cpu" else "auto"
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(
            str(base.root), local_files_only=True, trust_remote_code=False, dtype=dtype,
            use_safetensors=True,
        )
    except Exception as exc:
        raise CheckpointError(f"cannot load θ0 for the gradient pass: {exc}") from None
    model.to(device)
    return tokenizer, model.eval()


def gradient_scores(
    params: MaecParams,
    base: ModelFolder,
    corpus: str,
    names: list[str],
    device: torch.device,
    *,
    cancel: Callable[[], bool] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Float32 importance scores (per row or per element) of ``names``, on CPU."""
    tokenizer, model = _load(base, device)
    ids = corpus_tokens(corpus, tokenizer, params.token_budget)
    wanted = set(names)
    found: dict[str, torch.nn.Parameter] = {}
    for pname, p in model.named_parameters():
        p.requires_grad_(pname in wanted)
        if pname in wanted:
            found[pname] = p
    missing = sorted(wanted - set(found))
    if missing:
        raise CheckpointError(
            f"the gradient pass cannot find tensors {missing[:3]} among the model's "
            "parameters", tensors=missing[:10],
        )
    acc = {n: torch.zeros(p.shape, dtype=torch.float32, device=device) for n, p in found.items()}
    blocks = [ids[i: i + params.seq_len] for i in range(0, len(ids), params.seq_len)]
    # The last block may be short; it gets its own batch so nothing is padded.
    batches: list[list[list[int]]] = []
    for b in blocks:
        if len(b) < 2:
            continue
        if batches and len(batches[-1]) < params.batch_size and len(batches[-1][0]) == len(b):
            batches[-1].append(b)
        else:
            batches.append([b])
    # Losses stay on the device until the end: reading one per batch (float()) would
    # make the host wait for every batch's backward before queueing the next batch.
    losses: list[torch.Tensor] = []
    pin = device.type == "cuda"
    for batch in batches:
        if cancel is not None and cancel():
            raise Cancelled("extraction cancelled")
        x = torch.tensor(batch, dtype=torch.long)
        # Pinned, so the copy is queued behind the previous batch instead of waiting.
        x = (x.pin_memory() if pin else x).to(device, non_blocking=pin)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        losses.append(loss.detach())
        for n, p in found.items():
            assert p.grad is not None
            # In place with promotion: a bf16 gradient is added into the float32
            # accumulator without a float32 copy of it (on CPU the grads are float32).
            acc[n].add_(p.grad)
            p.grad = None
    scores: dict[str, torch.Tensor] = {}
    for n, g in acc.items():
        g.abs_()
        s = g.flatten() if params.granularity == "element" else g.reshape(g.shape[0], -1).mean(1)
        scores[n] = s.cpu()
    del model, acc
    stats = {
        "tokens": sum(len(b) for bt in batches for b in bt),
        "batches": len(batches),
        "sequences": sum(len(bt) for bt in batches),
        "mean_loss": sum(float(x) for x in losses) / len(losses),
    }
    return scores, stats
