"""Benchmark: `maec merge` against `mergekit-yaml` and the I/O floor, same task, same run.

Three bf16 Llama checkpoints of ~0.85B parameters (built once under bench/cache/), one
task-arithmetic recipe (base + two donors, weight 0.5 each), both tools on CPU as fresh
subprocesses. Each tool's wall time and peak RSS are measured by a fresh wrapper
process; every command runs once untimed first, then runs are interleaved (the order
rotated each round), and medians reported. The I/O floor reads every input file once and
writes one output-sized file. Before every run, untimed, a file of the output's size plus
1 GiB (within the free memory) is written and deleted, so that every command writes into
pages its VM backs: on a VM that hands free pages back to its host (this one), writing
into pages left free for a few seconds costs seconds of system time, by chance of timing
(docs/benchmarks.md). ``--no-prime`` measures the machine as it is.

Two recipes, each run by both tools, like for like. ``dtype: float32, out_dtype:
bfloat16`` (``maec`` and ``mergekit``): both compute in float32 and write bfloat16.
``dtype: bfloat16`` (``maec-bf16`` and ``mergekit-bf16``): both compute in bfloat16, as
most published recipes ask, and write the same bytes. Ours streams both: the bf16 run
takes the 16-bit path, the float32 run the float32 one.

    .venv/bin/python -m bench.engine [--runs 3] [--small | --shape 7b] [--layers N]
                                     [--no-mergekit] [--no-prime]

``--layers N`` keeps the shape's widths and cuts its depth to ``N`` layers (a family of
its own under bench/cache): a check of the 7B harness without 41 GB of inputs.
``--no-mergekit`` times ours and the floor only (at 7B each mergekit run takes minutes
and the goals are against the floor); the ratios to mergekit then print ``n/a``.

Ends with exactly one line: each recipe's ratios against mergekit on the same recipe
(``_bf16``: the bfloat16 one), each of our runs against the I/O floor, and our bf16 run
against our float32 run (``bf16_vs_fp32``); the same keys at every ``--shape``:
RESULT engine wall_ratio_vs_mergekit=… rss_ratio_vs_mergekit=… wall_ratio_vs_floor=…
wall_ratio_vs_mergekit_bf16=… rss_ratio_vs_mergekit_bf16=… wall_ratio_bf16_vs_fp32=…
rss_ratio_bf16_vs_fp32=… wall_ratio_bf16_vs_floor=…
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import time
from pathlib import Path

from bench.common import (
    CACHE,
    ROOT,
    VENV_BIN,
    LlamaShape,
    build_family,
    folder_bytes,
    fresh_dir,
    interleaved,
    io_floor_cmd,
    measured_runs,
    model_bench_parser,
    print_medians,
    write_ta_recipe,
)

FULL = LlamaShape(hidden=2048, layers=16, intermediate=5632, vocab=32000, heads=32,
                  kv_heads=8)
# For a quick check of the harness itself.
SMALL = LlamaShape(hidden=512, layers=4, intermediate=1408, vocab=8000, heads=8, kv_heads=2)
# LLaMA-2-7B's shape (6.7B parameters, 13.5 GB in bf16): inputs larger than this
# machine's RAM. Not part of CI; about 41 GB of inputs, built once under bench/cache.
SEVEN_B = LlamaShape(hidden=4096, layers=32, intermediate=11008, vocab=32000, heads=32,
                     kv_heads=32)
FAMILIES = {"small": (SMALL, "llama-small"), "0.85b": (FULL, "llama-0.85b"),
            "7b": (SEVEN_B, "llama-7b")}


def family_parser(doc: str | None) -> argparse.ArgumentParser:
    """:func:`model_bench_parser` plus ``--shape``: which family of checkpoints."""
    ap = model_bench_parser(doc)
    ap.add_argument("--shape", choices=sorted(FAMILIES), default="0.85b",
                    help="the checkpoints' shape (--small is --shape small)")
    ap.add_argument("--layers", type=int, default=None,
                    help="the shape with this many layers instead (a harness check)")
    return ap


def family(args: argparse.Namespace) -> tuple[LlamaShape, str]:
    shape, tag = FAMILIES["small" if args.small else args.shape]
    layers = getattr(args, "layers", None)
    if layers is not None and layers != shape.layers:
        if layers < 1:
            raise SystemExit("--layers must be at least 1")
        shape, tag = dataclasses.replace(shape, layers=layers), f"{tag}-{layers}l"
    return shape, tag


def ensure_models(shape: LlamaShape, tag: str) -> list[Path]:
    root = CACHE / tag
    folders = [root / "base", root / "donor1", root / "donor2"]
    if not all((f / "config.json").is_file() for f in folders):
        # The family and one output (each run's output and the floor's file are
        # removed before the next run), plus 5%: refused up front rather than failing on
        # a full disk half-way through building or merging.
        need = int((len(folders) + 1) * shape.params() * 2 * 1.05)
        free = shutil.disk_usage(CACHE if CACHE.exists() else CACHE.parent).free
        if free < need:
            raise SystemExit(f"{tag}: building and merging needs about {need / 1e9:.0f} GB "
                             f"free under {CACHE}, and {free / 1e9:.0f} GB are")
        started = time.perf_counter()
        print(f"building {len(folders)} checkpoints of {shape.params() / 1e9:.2f}B params "
              f"under {root} (once)", flush=True)
        build_family(folders, shape)
        print(f"built in {time.perf_counter() - started:.1f} s", flush=True)
    return folders


def ensure_native() -> None:
    """Build the compiled kernels if this checkout lacks them (``make setup`` does it
    too): without them the engine's results are the same, its time is not."""
    from maec_core import native

    if not native.available():
        try:
            native.build()
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"the native kernels are not built ({e}): timing the torch path", flush=True)


def main() -> None:
    ap = family_parser(__doc__)
    ap.add_argument("--no-mergekit", action="store_true",
                    help="time ours and the floor only (the ratios to mergekit print n/a)")
    ap.add_argument("--no-prime", action="store_true",
                    help="no pages primed before each run (the machine as it is)")
    args = ap.parse_args()
    ensure_native()
    shape, tag = family(args)
    folders = ensure_models(shape, tag)
    work = fresh_dir(CACHE / "work")
    # Both tools compute in the recipe's dtype: bfloat16 here (the default of most
    # published recipes), float32 with a bfloat16 output in the second.
    recipe = write_ta_recipe(folders, work / "recipe.yaml")
    recipe_fp32 = write_ta_recipe(folders, work / "recipe-fp32.yaml",
                                  dtype="float32", out_dtype="bfloat16")
    out = work / "out"
    out_bytes = folder_bytes(folders[0])
    in_bytes = sum(folder_bytes(f) for f in folders)
    print(f"inputs {in_bytes / 1e9:.2f} GB in 3 checkpoints, output {out_bytes / 1e9:.2f} GB",
          flush=True)
    # Our input-hash cache lives with the benchmark, not in ~/.cache. The `maec` script
    # imports the package the virtualenv was installed from, which may be another
    # checkout: the code timed is this checkout's.
    env = {"MAEC_CACHE_DIR": str(CACHE / "hash-cache"), "PYTHONPATH": str(ROOT)}

    commands: dict[str, list[str]] = {
        "maec": [str(VENV_BIN / "maec"), "merge", "--device", "cpu", str(recipe_fp32),
                 str(out)],
        "maec-bf16": [str(VENV_BIN / "maec"), "merge", "--device", "cpu", str(recipe),
                      str(out)],
        "mergekit": [str(VENV_BIN / "mergekit-yaml"), str(recipe_fp32), str(out)],
        "mergekit-bf16": [str(VENV_BIN / "mergekit-yaml"), str(recipe), str(out)],
        "floor": io_floor_cmd(folders, work / "floor.bin", out_bytes),
    }

    if args.no_mergekit:
        # At 7B each mergekit run takes minutes; the goals there are against the floor.
        del commands["mergekit"], commands["mergekit-bf16"]
    prime = 0 if args.no_prime else out_bytes + 2**30
    run = measured_runs(commands, env, [out, work / "floor.bin"], prime=prime)

    # Warm-up, not counted: every command once, floor first so the inputs are in the page
    # cache for all; imports (torch, transformers) come from the page cache afterwards;
    # our first run also hashes the inputs for the manifest (cached by file identity
    # afterwards, as in service use where the same checkpoints are merged again and again).
    width = max(len(k) for k in commands)
    for name in ["floor", *(k for k in commands if k != "floor")]:
        warm = run(name)
        print(f"warm-up {name:{width}s}   wall {warm.wall:6.2f} s  "
              f"rss {warm.rss / 1e9:5.2f} GB  cpu {warm.cpu:6.2f} s", flush=True)

    results = interleaved(list(commands), args.runs, run)

    med = print_medians(results)

    def ratio(ours: str, peer: str, which: int) -> str:
        return f"{med[ours][which] / med[peer][which]:.3f}" if peer in med else "n/a"

    print(f"RESULT engine wall_ratio_vs_mergekit={ratio('maec', 'mergekit', 0)} "
          f"rss_ratio_vs_mergekit={ratio('maec', 'mergekit', 1)} "
          f"wall_ratio_vs_floor={ratio('maec', 'floor', 0)} "
          f"wall_ratio_vs_mergekit_bf16={ratio('maec-bf16', 'mergekit-bf16', 0)} "
          f"rss_ratio_vs_mergekit_bf16={ratio('maec-bf16', 'mergekit-bf16', 1)} "
          f"wall_ratio_bf16_vs_fp32={ratio('maec-bf16', 'maec', 0)} "
          f"rss_ratio_bf16_vs_fp32={ratio('maec-bf16', 'maec', 1)} "
          f"wall_ratio_bf16_vs_floor={ratio('maec-bf16', 'floor', 0)}")


if __name__ == "__main__":
    main()
