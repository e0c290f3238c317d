"""Benchmark: a vocabulary-extended merge (``tokenizer_source: union``), `maec merge`
against `mergekit-yaml` on the same inputs, in the same run.

Three bf16 Llama checkpoints (built once under bench/cache/): a base with a 32,000-token
tokenizer, a fine-tune of it, and a language base whose tokenizer appends 4,000 tokens
(its embedding and LM head have the extra rows). One task-arithmetic recipe with the
union tokenizer; both tools on CPU as fresh subprocesses, runs interleaved, medians.

    .venv/bin/python -m bench.engine_vocab [--runs 3] [--small]

Ends with exactly one line:
RESULT engine_vocab wall_ratio_vs_mergekit=… rss_ratio_vs_mergekit=…
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import yaml

from bench.common import (
    CACHE,
    VENV_BIN,
    LlamaShape,
    Measured,
    build_family,
    interleaved,
    measure,
    median,
)

# Embedding-heavy, as vocabulary merges are: 0.35B parameters, a third of them in the
# embedding and LM head.
SHAPE = LlamaShape(hidden=2048, layers=4, intermediate=5632, vocab=32000, heads=32,
                   kv_heads=8)
SMALL = LlamaShape(hidden=256, layers=2, intermediate=704, vocab=4000, heads=8, kv_heads=2)
NEW_TOKENS = 4000


def _tokenizer(folder: Path, size: int, extra: int) -> None:
    """A WordLevel tokenizer of ``size`` words plus ``extra`` appended ones."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, size)}}
    vocab.update({f"l{i}": size + i for i in range(extra)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)


def ensure_models(shape: LlamaShape, tag: str) -> list[Path]:
    """base and donor (shape), lang (shape with NEW_TOKENS more rows); the first rows of
    every tensor are drawn from the same per-tensor seed, so lang is a fine-tune of base
    with rows appended."""
    root = CACHE / tag
    base, donor, lang = root / "base", root / "donor", root / "lang"
    if all((f / "tokenizer.json").is_file() for f in (base, donor, lang)):
        return [base, donor, lang]
    started = time.perf_counter()
    print(f"building 3 checkpoints under {root} (once)", flush=True)
    build_family([base, donor], shape)
    wide = LlamaShape(shape.hidden, shape.layers, shape.intermediate,
                      shape.vocab + NEW_TOKENS, shape.heads, shape.kv_heads)
    scratch = root / "scratch-base"
    build_family([scratch, lang], wide, seed=0, noise=0.003)
    shutil.rmtree(scratch)
    for folder in (base, donor):
        _tokenizer(folder, shape.vocab, 0)
    _tokenizer(lang, shape.vocab, NEW_TOKENS)
    print(f"built in {time.perf_counter() - started:.1f} s", flush=True)
    return [base, donor, lang]


def write_recipe(folders: list[Path], path: Path) -> Path:
    base, donor, lang = folders
    doc = {
        "merge_method": "task_arithmetic",
        "base_model": str(base),
        "models": [{"model": str(donor), "parameters": {"weight": 0.5}},
                   {"model": str(lang), "parameters": {"weight": 0.5}}],
        "tokenizer_source": "union",
        "dtype": "bfloat16",
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="tiny models, harness check only")
    args = ap.parse_args()
    shape, tag = (SMALL, "vocab-small") if args.small else (SHAPE, "vocab-0.35b")
    folders = ensure_models(shape, tag)
    work = CACHE / "work-vocab"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    recipe = write_recipe(folders, work / "recipe.yaml")
    out = work / "out"
    env = {"MAEC_CACHE_DIR": str(CACHE / "hash-cache")}
    commands = {
        "maec": [str(VENV_BIN / "maec"), "merge", "--device", "cpu", str(recipe), str(out)],
        "mergekit": [str(VENV_BIN / "mergekit-yaml"), str(recipe), str(out)],
    }

    def run(name: str) -> Measured:
        shutil.rmtree(out, ignore_errors=True)
        try:
            return measure(commands[name], env=env)
        finally:
            shutil.rmtree(out, ignore_errors=True)

    # Warm-up, not counted: page cache, and our first-time input hashing.
    warm = run("maec")
    print(f"warm-up maec       wall {warm.wall:6.2f} s  rss {warm.rss / 1e9:5.2f} GB",
          flush=True)
    results = interleaved(list(commands), args.runs, run)
    med = {k: (median([m.wall for m in v]), median([m.rss for m in v]))
           for k, v in results.items()}
    for k, (w, r) in med.items():
        print(f"median {k:9s}    wall {w:6.2f} s  rss {r / 1e9:5.2f} GB")
    print(f"RESULT engine_vocab wall_ratio_vs_mergekit={med['maec'][0] / med['mergekit'][0]:.3f} "
          f"rss_ratio_vs_mergekit={med['maec'][1] / med['mergekit'][1]:.3f}")


if __name__ == "__main__":
    main()
