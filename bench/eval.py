"""Benchmark: evaluation throughput against a plain transformers loop.

A small local Llama (built once under bench/cache/, never downloaded) and seeded random
word data. In one process, on the same loaded model, interleaved, medians of ``--runs``:

- ``ppl``: :func:`maec_core.eval.measure.score_texts` (sliding windows, batched) beside
  the transformers documentation's sliding-window loop batched the same way (windows in
  document order, right padding, ``labels`` with -100, loss x scored tokens);
- ``gen``: :func:`maec_core.eval.measure.generate` (greedy, left padding, batched)
  beside ``tokenizer(padding=True)`` + ``model.generate`` on the same prompts in the same
  batch size.

Both sides score the same tokens and generate the same tokens (checked). The RESULT
ratios are of wall-clock medians; the lines above them also give the ratio per CPU
second (steadier on a busy machine). One more line times the whole ``evaluate`` call
(model load, set reading, both sets) for reference.

    .venv/bin/python -m bench.eval [--runs 5] [--threads 1]

Ends with exactly one line:
RESULT eval ppl_tokens_per_s_ratio=<ours/plain> gen_tokens_per_s_ratio=<ours/plain>
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import CACHE, Measured, interleaved, median
from maec_core.context import RunContext

MODEL = CACHE / "eval-model"
DATA = CACHE / "eval-data"
VOCAB = 4000
SHAPE: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
                         "num_attention_heads": 8, "num_key_value_heads": 4,
                         "max_position_embeddings": 512}
CONTEXT, STRIDE, PPL_BATCH = 256, 128, 4
DOCS, DOC_WORDS = 6, 900
PROMPTS, GEN_BATCH, NEW_TOKENS = 24, 8, 40


def ensure_model() -> Path:
    """A seeded random Llama with a word-level tokenizer (BOS added like Llama's)."""
    if (MODEL / "config.json").exists():
        return MODEL
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3,
             **{f"t{i}": i + 4 for i in range(VOCAB - 4)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                 eos_token="</s>", pad_token="<pad>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
                                         pad_token_id=3, **SHAPE))
    tmp = MODEL.with_name(MODEL.name + ".partial")
    model.save_pretrained(tmp)
    hf.save_pretrained(tmp)
    tmp.rename(MODEL)
    return MODEL


def ensure_data() -> Path:
    """A text set, a question set and the spec naming both."""
    rng = random.Random(0)

    def words(n: int) -> str:
        return " ".join(f"t{rng.randrange(VOCAB - 4)}" for _ in range(n))

    DATA.mkdir(parents=True, exist_ok=True)
    (DATA / "texts.jsonl").write_text(
        "".join(json.dumps({"text": words(DOC_WORDS)}) + "\n" for _ in range(DOCS)))
    (DATA / "qa.jsonl").write_text("".join(
        json.dumps({"question": words(rng.randrange(20, 90)), "answer": 1}) + "\n"
        for _ in range(PROMPTS)))
    spec = DATA / "eval.yaml"
    spec.write_text(
        f"sets:\n"
        f"  - {{name: ppl, language: en, kind: perplexity, path: texts.jsonl, "
        f"context: {CONTEXT}, stride: {STRIDE}, batch_size: {PPL_BATCH}}}\n"
        f"  - {{name: gen, language: en, kind: accuracy, path: qa.jsonl, "
        f"template: '{{question}}', stop: [], max_new_tokens: {NEW_TOKENS}, "
        f"batch_size: {GEN_BATCH}}}\n")
    return spec


@torch.inference_mode()
def plain_perplexity(model: Any, tok: Any, texts: list[str]) -> tuple[float, int]:
    """The transformers docs' sliding-window loop, batched: summed NLL, scored tokens."""
    windows = []
    for text in texts:
        ids = tok(text)["input_ids"]
        prev_end = 0
        for begin in range(0, len(ids), STRIDE):
            end = min(begin + CONTEXT, len(ids))
            windows.append((ids[begin:end], end - prev_end))
            prev_end = end
            if end == len(ids):
                break
    total, count = 0.0, 0
    for i in range(0, len(windows), PPL_BATCH):
        batch = windows[i: i + PPL_BATCH]
        width = max(len(w) for w, _ in batch)
        x = torch.full((len(batch), width), tok.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, (w, trg) in enumerate(batch):
            x[j, : len(w)] = torch.tensor(w)
            mask[j, : len(w)] = 1
            labels[j, len(w) - trg: len(w)] = torch.tensor(w[len(w) - trg:])
        scored = int((labels[:, 1:] != -100).sum())
        loss = model(input_ids=x, attention_mask=mask, labels=labels).loss
        total += float(loss) * scored
        count += scored
    return total, count


@torch.inference_mode()
def plain_generate(model: Any, tok: Any, prompts: list[str]) -> tuple[list[str], int]:
    """Left-padded batches of ``model.generate``: texts and new tokens (to EOS)."""
    tok.padding_side = "left"
    texts: list[str] = []
    tokens = 0
    eos = tok.eos_token_id
    for i in range(0, len(prompts), GEN_BATCH):
        enc = tok(prompts[i: i + GEN_BATCH], return_tensors="pt", padding=True)
        out = model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        for row in out[:, enc["input_ids"].shape[1]:].tolist():
            n = row.index(eos) + 1 if eos in row else len(row)
            tokens += n
            texts.append(tok.decode(row[:n], skip_special_tokens=True))
    return texts, tokens


def compare(model: Any, tok: Any, texts: list[str], prompts: list[str],
            runs: int) -> dict[str, float]:
    """Interleaved timings of both sides; tokens per second of each, after checking that
    both scored and generated the same tokens."""
    from maec_core.eval.measure import generate, score_texts

    device = torch.device("cpu")
    counts: dict[str, int] = {}
    outputs: dict[str, Any] = {}
    cpu: dict[str, list[float]] = {}

    def run(name: str) -> Measured:
        t0, c0 = time.perf_counter(), time.process_time()
        if name == "ppl-ours":
            docs = score_texts(model, tok, texts, context=CONTEXT, stride=STRIDE,
                               batch_size=PPL_BATCH, device=device)
            counts[name] = sum(d.tokens for d in docs)
            outputs[name] = sum(d.nll for d in docs) / counts[name]
        elif name == "ppl-plain":
            nll, counts[name] = plain_perplexity(model, tok, texts)
            outputs[name] = nll / counts[name]
        elif name == "gen-ours":
            gens = generate(model, tok, prompts, max_new_tokens=NEW_TOKENS,
                            batch_size=GEN_BATCH, stop=[], device=device)
            counts[name] = sum(g.tokens for g in gens)
            outputs[name] = [g.output for g in gens]
        else:
            outputs[name], counts[name] = plain_generate(model, tok, prompts)
        wall = time.perf_counter() - t0
        cpu.setdefault(name, []).append(time.process_time() - c0)
        return Measured(wall, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)

    names = ["ppl-ours", "ppl-plain", "gen-ours", "gen-plain"]
    for name in names:  # warm-up: first-call allocations and lazy imports
        run(name)
    results = interleaved(names, runs, run)
    assert counts["ppl-ours"] == counts["ppl-plain"], counts
    assert abs(outputs["ppl-ours"] - outputs["ppl-plain"]) < 1e-4, outputs
    same = sum(a == b for a, b in zip(outputs["gen-ours"], outputs["gen-plain"], strict=True))
    assert counts["gen-ours"] == counts["gen-plain"] and same == PROMPTS, (counts, same)
    rate = {n: counts[n] / median([m.wall for m in results[n]]) for n in names}
    # CPU seconds too: on a busy shared machine they vary less than wall seconds.
    cpu_ratio = {k: median(cpu[f"{k}-plain"][1:]) / median(cpu[f"{k}-ours"][1:])
                 for k in ("ppl", "gen")}
    print(f"perplexity: ours {rate['ppl-ours']:,.0f} tokens/s, plain {rate['ppl-plain']:,.0f} "
          f"tokens/s ({counts['ppl-ours']} scored tokens, mean NLL equal to 1e-4); "
          f"per CPU second {cpu_ratio['ppl']:.3f}")
    print(f"generation: ours {rate['gen-ours']:,.0f} tokens/s, plain "
          f"{rate['gen-plain']:,.0f} tokens/s ({counts['gen-ours']} new tokens, "
          f"{same}/{PROMPTS} outputs identical); per CPU second {cpu_ratio['gen']:.3f}")
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: steady timings on a shared machine)")
    args = ap.parse_args()
    from maec_core.runtime import torch_threads

    with torch_threads(args.threads):
        measure_all(args.runs, args.threads)


def measure_all(runs: int, threads: int) -> None:
    from maec_core.eval.loading import load_model
    from maec_core.eval.runner import evaluate
    from maec_core.eval.sets import load_sets, load_spec

    spec = load_spec(ensure_data())
    ppl_set, gen_set = load_sets(spec)
    loaded = load_model(ensure_model(), torch.device("cpu"))
    params = sum(p.numel() for p in loaded.model.parameters())
    print(f"model: Llama {params / 1e6:.1f}M params, float32, CPU, {threads} thread(s); "
          f"ppl: {DOCS} docs x {DOC_WORDS} words, context {CONTEXT}, stride {STRIDE}, "
          f"batch {PPL_BATCH}; gen: {PROMPTS} prompts, {NEW_TOKENS} new tokens, "
          f"batch {GEN_BATCH}", flush=True)
    rate = compare(loaded.model, loaded.tokenizer, list(ppl_set.texts),
                   [it.question for it in gen_set.items], runs)
    del loaded
    t0 = time.perf_counter()
    report = evaluate(MODEL, spec, RunContext(device="cpu"))
    print(f"whole evaluate() (load + read sets + both sets): {time.perf_counter() - t0:.2f} s; "
          f"ppl {report.models[0].sets[0].value:.1f}", flush=True)
    print(f"RESULT eval ppl_tokens_per_s_ratio={rate['ppl-ours'] / rate['ppl-plain']:.3f} "
          f"gen_tokens_per_s_ratio={rate['gen-ours'] / rate['gen-plain']:.3f}")


if __name__ == "__main__":
    main()
