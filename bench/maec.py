"""Benchmark: MAEC (full, and combine-only from a cached artifact) against task arithmetic.

The engine benchmark's three bf16 Llama checkpoints of ~0.85B parameters (bench/cache/,
built once by ``bench.engine.ensure_models``): θ0 = base, θA = donor1, θL = donor2. In
one run, as fresh subprocesses on CPU, interleaved, medians of ``--runs``:

- ``full``: ``maec_core.run.run`` with ``importance: delta`` and an empty artifact store
  (extraction + combination);
- ``combine``: ``combine`` from the artifact extracted once during warm-up;
- ``ta``: the engine's task arithmetic on the same inputs, ``θ0 + (θA − θ0) + (θL − θ0)``;
- ``full-torch`` (when ``maec_core.native`` is built): ``full`` with its row scores
  through torch (``MAEC_NATIVE=0``), the same bytes without the compiled kernel;
- ``floor-ta`` and ``floor-maec``: each method's I/O alone (``bench.common.io_phases_cmd``):
  the three inputs read while an output-sized file is written, against θ0 and θA read
  first and then θL read while it is written, the order MAEC's result depends on.

Then ``importance: gradient`` on a small model: tokens per second of the gradient pass,
beside the forward+backward throughput of the same model and batches in plain
transformers, measured in the same process.

    .venv/bin/python -m bench.maec [--runs 3] [--small | --shape 7b]

Ends with a line giving ``full-torch``'s ratio (when it ran), then exactly one line:
RESULT maec full_vs_ta=… combine_vs_ta=… artifact_ratio=… rss_ratio_vs_ta=…
floor_maec_vs_ta=…
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench.common import (
    CACHE,
    ROOT,
    LlamaShape,
    folder_bytes,
    fresh_dir,
    interleaved,
    io_phases_cmd,
    measure,
    measured_runs,
    median,
)
from bench.engine import ensure_models, family, family_parser
from maec_core import native
from maec_core.context import RunContext

WORK = CACHE / "maec-work"
KEY_RATIO = 0.05
# The gradient-mode model: small enough for a CPU, real Llama blocks.
GRAD_SHAPE = LlamaShape(hidden=256, layers=4, intermediate=704, vocab=2000, heads=8,
                        kv_heads=4)
GRAD = {"token_budget": 8192, "seq_len": 256, "batch_size": 4}


def maec_recipe(folders: list[Path], **params: Any) -> dict[str, Any]:
    base, ability, lang = folders
    return {"merge_method": "maec", "base_model": str(base), "language_base": str(lang),
            "abilities": [{"model": str(ability), "name": "ability"}],
            "parameters": {"key_ratio": KEY_RATIO, **params}, "dtype": "bfloat16"}


def ta_recipe(folders: list[Path]) -> dict[str, Any]:
    base, ability, lang = folders
    return {"merge_method": "task_arithmetic", "base_model": str(base),
            "models": [{"model": str(ability), "parameters": {"weight": 1.0}},
                       {"model": str(lang), "parameters": {"weight": 1.0}}],
            # MAEC accumulates in float32: the engine's float32 path, written as bf16, is
            # the like-for-like peer (as in bench.engine).
            "dtype": "float32", "out_dtype": "bfloat16"}


# --- the measured child processes ------------------------------------------------------


def child(argv: list[str]) -> None:
    mode, recipe_path, out = argv[0], Path(argv[1]), Path(argv[2])
    recipe = yaml.safe_load(recipe_path.read_text())
    from maec_core.parsing import parse_recipe

    parsed = parse_recipe(recipe)
    # The input-digest cache the parent chose (kept with the benchmark, not in ~/.cache).
    hash_cache = Path(os.environ["MAEC_CACHE_DIR"]) / "sha256"
    if mode == "ta":
        from maec_core.run import run

        run(parsed, out, RunContext(device="cpu", hash_cache=hash_cache))
    elif mode == "full":
        from maec_core.artifact_store import LocalArtifactStore
        from maec_core.run import run

        # An empty store: this run must extract.
        store = LocalArtifactStore(out.with_name(out.name + ".store"))
        try:
            run(parsed, out, RunContext(device="cpu", artifact_store=store, hash_cache=hash_cache))
        finally:
            shutil.rmtree(store.root, ignore_errors=True)
    elif mode == "combine":
        from maec_core.maec.pipeline import combine

        combine(parsed, [Path(argv[3])], out, RunContext(device="cpu", hash_cache=hash_cache))
    elif mode == "extract":
        from maec_core.maec.pipeline import extract

        extract(parsed, 0, out, RunContext(device="cpu", hash_cache=hash_cache))
    else:
        raise SystemExit(f"unknown child mode {mode}")


# --- gradient mode throughput -----------------------------------------------------------


def _grad_models() -> tuple[Path, Path]:
    """A small random Llama with a word-level tokenizer, plus a fine-tune, and a corpus."""
    root = CACHE / "maec-grad"
    base = root / "base"
    if not (base / "tokenizer.json").is_file():
        import torch
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

        shutil.rmtree(root, ignore_errors=True)
        cfg = LlamaConfig(**{k: v for k, v in GRAD_SHAPE.config().items()
                             if k not in ("dtype", "torch_dtype")})
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(base)
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2,
                 **{f"w{i}": i + 3 for i in range(GRAD_SHAPE.vocab - 3)}}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                eos_token="</s>").save_pretrained(base)
        rng = random.Random(0)
        with open(root / "corpus.jsonl", "w") as f:
            for _ in range(200):
                words = " ".join(f"w{rng.randrange(GRAD_SHAPE.vocab - 3)}" for _ in range(100))
                f.write(json.dumps({"text": words}) + "\n")
    return base, root / "corpus.jsonl"


def gradient_bench() -> str:
    import torch
    from transformers import AutoModelForCausalLM

    from maec_core.io.folder import open_model_folder
    from maec_core.maec.gradient import corpus_tokens, gradient_scores
    from maec_core.maec.params import MaecParams

    base, corpus = _grad_models()
    params = MaecParams.model_validate({"importance": "gradient", **GRAD})
    folder = open_model_folder(base)
    names = [n for n, t in folder.tensors.items() if params.is_included(n, len(t.shape))]
    device = torch.device("cpu")
    # Plain transformers: the same model, the same batches, forward + backward.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    ids = corpus_tokens(corpus, tok, params.token_budget)
    model = AutoModelForCausalLM.from_pretrained(str(base), local_files_only=True,
                                                 dtype=torch.float32)
    x = torch.tensor(ids).reshape(-1, params.batch_size, params.seq_len)
    rates: dict[str, list[float]] = {"maec": [], "plain": []}
    for _ in range(3):
        t0 = time.perf_counter()
        _, stats = gradient_scores(params, folder, str(corpus), names, device)
        rates["maec"].append(stats["tokens"] / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        for batch in x:
            model(input_ids=batch, labels=batch).loss.backward()
            model.zero_grad(set_to_none=True)
        rates["plain"].append(x.numel() / (time.perf_counter() - t0))
    maec, plain = median(rates["maec"]), median(rates["plain"])
    return (f"gradient importance ({GRAD_SHAPE.params() / 1e6:.0f}M params, "
            f"{params.token_budget} tokens, batch {params.batch_size}x{params.seq_len}, CPU): "
            f"{maec:,.0f} tokens/s end to end (model load + tokenize + fwd/bwd + "
            f"accumulate); plain transformers fwd+bwd {plain:,.0f} tokens/s "
            f"(ratio {maec / plain:.2f})")


# --- driver -------------------------------------------------------------------------------


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return
    ap = family_parser(__doc__)
    ap.add_argument("--no-gradient", action="store_true", help="skip the gradient timing")
    args = ap.parse_args()

    shape, tag = family(args)
    folders = ensure_models(shape, tag)[:3]
    fresh_dir(WORK)
    recipes = {"maec": WORK / "maec.yaml", "ta": WORK / "ta.yaml"}
    recipes["maec"].write_text(yaml.safe_dump(maec_recipe(folders)))
    recipes["ta"].write_text(yaml.safe_dump(ta_recipe(folders)))
    out, artifact, floor = WORK / "out", WORK / "artifact", WORK / "floor.bin"
    model_bytes = folder_bytes(folders[0])
    print(f"θ0/θA/θL: {model_bytes / 1e9:.2f} GB each ({shape.params() / 1e9:.2f}B params, "
          f"bf16); key_ratio {KEY_RATIO}", flush=True)
    env = {"MAEC_CACHE_DIR": str(CACHE / "hash-cache"),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    me = [sys.executable, "-m", "bench.maec", "--child"]
    commands = {
        "full": [*me, "full", str(recipes["maec"]), str(out)],
        "combine": [*me, "combine", str(recipes["maec"]), str(out), str(artifact)],
        "ta": [*me, "ta", str(recipes["ta"]), str(out)],
        "floor-ta": io_phases_cmd([folders], floor, model_bytes),
        "floor-maec": io_phases_cmd([folders[:2], folders[2:]], floor, model_bytes),
    }
    if native.available():
        # The same merge with row scores through torch: what the compiled kernel saves.
        commands["full-torch"] = ["env", "MAEC_NATIVE=0", *commands["full"]]

    run = measured_runs(commands, env, [out, floor])

    # Warm-up, not counted: pulls inputs into the page cache, hashes them once (the
    # stat-keyed cache then serves every run, as in service use), extracts the artifact.
    ext = measure([*me, "extract", str(recipes["maec"]), str(artifact)], env=env)
    print(f"warm-up extract    wall {ext.wall:6.2f} s  rss {ext.rss / 1e9:5.2f} GB", flush=True)
    warm = run("ta")
    print(f"warm-up ta         wall {warm.wall:6.2f} s  rss {warm.rss / 1e9:5.2f} GB", flush=True)
    art_bytes = sum(p.stat().st_size for p in artifact.iterdir())
    meta = json.loads((artifact / "ability.json").read_text())
    included = meta["totals"]["candidates"] and sum(
        e["candidates"] * e["row_width"] for e in meta["tensors"])
    print(f"artifact {art_bytes / 1e6:.1f} MB = {art_bytes / model_bytes:.4f} of the model, "
          f"{art_bytes / (2 * included):.4f} of the included tensors' bytes "
          f"(key_ratio {KEY_RATIO})", flush=True)

    results = interleaved(list(commands), args.runs, run)
    wall = {k: median([m.wall for m in v]) for k, v in results.items()}
    rss = {k: median([m.rss for m in v]) for k, v in results.items()}
    for k in commands:
        print(f"median {k:10s} wall {wall[k]:6.2f} s  rss {rss[k] / 1e9:5.2f} GB")
    if not args.no_gradient:
        print(gradient_bench(), flush=True)
    shutil.rmtree(WORK, ignore_errors=True)
    if "full-torch" in wall:
        print(f"row scores through torch (MAEC_NATIVE=0): full_vs_ta="
              f"{wall['full-torch'] / wall['ta']:.3f}")
    print(f"RESULT maec full_vs_ta={wall['full'] / wall['ta']:.3f} "
          f"combine_vs_ta={wall['combine'] / wall['ta']:.3f} "
          f"artifact_ratio={art_bytes / model_bytes:.4f} "
          f"rss_ratio_vs_ta={rss['full'] / rss['ta']:.3f} "
          f"floor_maec_vs_ta={wall['floor-maec'] / wall['floor-ta']:.3f}")


if __name__ == "__main__":
    main()
