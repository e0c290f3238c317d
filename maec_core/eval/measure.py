"""The torch side of evaluation: sliding-window perplexity and batched greedy answers.

Both take a loaded model and tokenizer, so the same code serves one model folder, a
sweep of candidates, or a benchmark against a plain transformers loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from maec_core.errors import Cancelled
from maec_core.eval.report import DocumentScore
from maec_core.runtime import CancelFn

# on_batch(done, total), called after each batch.
BatchFn = Callable[[int, int], None]


@dataclass(frozen=True)
class BatchHooks:
    """Called between batches: ``on_batch(done, total)`` after each, ``cancel()`` before
    each (True stops the scoring with ``Cancelled``)."""

    on_batch: BatchFn | None = None
    cancel: CancelFn | None = None
IGNORE = -100


def sliding_windows(n_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """``(start, end, score_from)`` windows over a document of ``n_tokens`` tokens.

    Windows of ``context`` tokens start every ``stride`` tokens; each scores only the
    tokens no earlier window scored (``score_from`` .. ``end``), predicted with the
    window's preceding tokens as context (the transformers recipe). With
    ``stride < context`` every token but the document's first is scored exactly once;
    with ``stride == context`` a window's first token has nothing before it in its
    window and is not scored either.
    """
    if not 1 <= stride <= context:
        raise ValueError(f"need 1 <= stride <= context, got stride {stride}, context {context}")
    out: list[tuple[int, int, int]] = []
    prev_end = 0
    for start in range(0, n_tokens, stride):
        end = min(start + context, n_tokens)
        score_from = max(prev_end, start + 1)
        if end > score_from:
            out.append((start, end, score_from))
        prev_end = end
        if end == n_tokens:
            break
    return out


def _check_cancel(cancel: CancelFn | None) -> None:
    if cancel is not None and cancel():
        raise Cancelled("evaluation cancelled")


def pad_id(tokenizer: Any, model: Any) -> int:
    """The id that fills padding (never scored, always masked)."""
    for candidate in (tokenizer.pad_token_id, model.generation_config.pad_token_id,
                      tokenizer.eos_token_id):
        if isinstance(candidate, int):
            return candidate
    return 0


@torch.inference_mode()
def window_nll(model: Any, rows: Sequence[Sequence[int]], score_from: Sequence[int],
               pad: int, device: torch.device) -> list[float]:
    """Summed NLL (nats) of each row's tokens from ``score_from[i]`` on, one forward.

    Rows are right-padded; the padding is masked and never scored, and under a causal
    mask it cannot affect the real tokens before it.
    """
    width = max(len(r) for r in rows)
    x = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, first) in enumerate(zip(rows, score_from, strict=True)):
        t = torch.tensor(row, dtype=torch.long)
        x[i, : len(row)] = t
        labels[i, first: len(row)] = t[first:]
        mask[i, : len(row)] = 1
    # Without padding, no mask: attention then takes its plain causal path.
    padded = bool((mask == 0).any())
    logits = model(input_ids=x.to(device),
                   attention_mask=mask.to(device) if padded else None).logits
    labels = labels.to(device)
    # Row by row: the float32 copy of one row's logits, not the batch's (at a 128k
    # vocabulary and 1024 tokens that is 0.5 GB per row).
    sums = [F.cross_entropy(logits[i, :-1].float(), labels[i, 1:], ignore_index=IGNORE,
                            reduction="sum") for i in range(len(rows))]
    return [float(v) for v in torch.stack(sums).double().cpu()]


def score_texts(model: Any, tokenizer: Any, texts: Sequence[str], *, context: int,
                stride: int, batch_size: int, device: torch.device,
                hooks: BatchHooks = BatchHooks()) -> list[DocumentScore]:
    """Per-document token counts and summed NLL under sliding windows, batched.

    Each document is tokenized on its own (with the tokenizer's special tokens, as the
    model saw text in training) and windows never cross documents. Windows are batched
    longest first so a batch pads little; the result does not depend on the order.
    """
    # verbose=False: documents longer than the model's window are expected here.
    ids: list[list[int]] = tokenizer(list(texts), verbose=False)["input_ids"]
    windows = [(d, *w) for d, doc in enumerate(ids)
               for w in sliding_windows(len(doc), context, stride)]
    windows.sort(key=lambda w: w[2] - w[1], reverse=True)
    nll = [0.0] * len(texts)
    tokens = [0] * len(texts)
    batches = [windows[i: i + batch_size] for i in range(0, len(windows), batch_size)]
    pad = pad_id(tokenizer, model)
    for b, batch in enumerate(batches, 1):
        _check_cancel(hooks.cancel)
        rows = [ids[d][s:e] for d, s, e, _ in batch]
        sums = window_nll(model, rows, [f - s for _, s, _, f in batch], pad, device)
        for (d, _, e, f), v in zip(batch, sums, strict=True):
            nll[d] += v
            tokens[d] += e - f
        if hooks.on_batch is not None:
            hooks.on_batch(b, len(batches))
    return [DocumentScore(index=d, tokens=tokens[d], nll=nll[d]) for d in range(len(texts))]


@dataclass(frozen=True)
class Generation:
    output: str
    tokens: int


def eos_ids(tokenizer: Any, model: Any) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list | tuple) else [int(eos)]


def _cut(text: str, stop: Sequence[str]) -> str:
    """``text`` up to the earliest stop string."""
    ends = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[: min(ends)] if ends else text


@torch.inference_mode()
def generate(model: Any, tokenizer: Any, prompts: Sequence[str], *, max_new_tokens: int,
             batch_size: int, stop: Sequence[str], device: torch.device,
             hooks: BatchHooks = BatchHooks()) -> list[Generation]:
    """Greedy continuations of ``prompts``, batched with left padding.

    A row ends at an end-of-sequence token, at a stop string (cut from the output), or
    after ``max_new_tokens``. Prompts are batched longest first so a batch pads little;
    results come back in prompt order.
    """
    ids: list[list[int]] = tokenizer(list(prompts), verbose=False)["input_ids"]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]), reverse=True)
    batches = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
    eos, pad = eos_ids(tokenizer, model), pad_id(tokenizer, model)
    out: list[Generation | None] = [None] * len(ids)
    for b, batch in enumerate(batches, 1):
        _check_cancel(hooks.cancel)
        rows = _generate_batch(model, tokenizer, [ids[i] for i in batch], eos, pad,
                               max_new_tokens, stop, device)
        for i, row in zip(batch, rows, strict=True):
            out[i] = Generation(_cut(tokenizer.decode(row, skip_special_tokens=True), stop),
                                len(row))
        if hooks.on_batch is not None:
            hooks.on_batch(b, len(batches))
    return [g for g in out if g is not None]


class _StopAt:
    """Ends a row once its decoded tail holds a stop string (transformers' own
    ``stop_strings`` needs tokenizers whose tokens decode independently, which not all
    do). The output is cut again from its full decoding, so this only saves steps."""

    # A stop string has at most 64 characters, so it lies within the last 64 tokens
    # that decode to text; a margin covers tokens that decode to nothing.
    TAIL = 80

    def __init__(self, tokenizer: Any, stop: Sequence[str], prompt_width: int) -> None:
        self.tokenizer, self.stop, self.width = tokenizer, list(stop), prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor,
                 **kwargs: Any) -> torch.Tensor:
        tails = input_ids[:, max(self.width, input_ids.shape[1] - self.TAIL):].tolist()
        texts = self.tokenizer.batch_decode(tails, skip_special_tokens=True)
        hit = [any(s in t for s in self.stop) for t in texts]
        return torch.tensor(hit, dtype=torch.bool, device=input_ids.device)


def _generate_batch(model: Any, tokenizer: Any, rows: list[list[int]], eos: list[int],
                    pad: int, max_new_tokens: int, stop: Sequence[str],
                    device: torch.device) -> list[list[int]]:
    """The new tokens of each row, up to and including its end-of-sequence token."""
    from transformers import StoppingCriteriaList

    width = max(len(r) for r in rows)
    x = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        x[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    criteria = StoppingCriteriaList([_StopAt(tokenizer, stop, width)] if stop else [])
    # Sampling settings in the folder's generation config are overridden: greedy only.
    result = model.generate(
        input_ids=x.to(device), attention_mask=mask.to(device), do_sample=False,
        num_beams=1, temperature=None, top_p=None, top_k=None,
        max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=eos or None,
        stopping_criteria=criteria,
    )
    done: list[list[int]] = []
    for row in result[:, width:].tolist():
        end = next((j for j, t in enumerate(row) if t in eos), None)
        if end is not None:
            row = row[: end + 1]
        elif pad not in eos:
            # Stopped by a stop string: padded from there until the batch ended.
            while row and row[-1] == pad:
                row.pop()
        done.append(row)
    return done
