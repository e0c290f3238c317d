"""``make bench-gpu``: our engine on a GPU against ``mergekit-yaml --cuda`` and the I/O floor.

On a CUDA machine: builds three bf16 Llama checkpoints of about 3.4B parameters locally
(seeded, written tensor by tensor from a Llama config; nothing from a hub), then, as
fresh subprocesses, interleaved, medians of ``--runs`` after one uncounted warm-up:

- ``ta-cuda`` / ``ta-cpu``: task arithmetic through our engine on the GPU / the CPU;
- ``maec-cuda`` / ``maec-cpu``: the full MAEC merge (extraction with an empty artifact
  store, then combination), ``importance: delta``;
- ``mergekit-cuda``: ``mergekit-yaml --cuda`` on the same task-arithmetic recipe,
  computing in float32 as ours does (``dtype: float32``, ``out_dtype: bfloat16``);
- ``floor``: read every input once and write the output's bytes, no math.

Then each GPU output is checked against the CPU output tensor by tensor: bit-identical,
or the largest absolute difference and how many tensors differ (a GPU may fuse a
multiply and an add into one rounding, where the CPU rounds twice).

Ends with exactly one line:
RESULT gpu wall_ratio_vs_mergekit_cuda=<ta-cuda/mergekit-cuda>
wall_ratio_vs_floor=<ta-cuda/floor> maec_full_vs_ta=<maec-cuda/ta-cuda>

Without a CUDA device it says so and exits 0. ``--dry-run`` runs the whole harness on a
tiny shape with the "cuda" legs on the CPU (and mergekit without ``--cuda``): how the
tests check it.

    .venv/bin/python -m bench.gpu [--runs 2] [--dry-run] [--work DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

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
from maec_core.context import RunContext

# About 3.4B parameters: 32 layers of hidden 3072 / MLP 8192, GQA 24:8, 32000 tokens.
FULL = LlamaShape(hidden=3072, layers=32, intermediate=8192, vocab=32000, heads=24,
                  kv_heads=8)
TINY = LlamaShape(hidden=64, layers=2, intermediate=160, vocab=512, heads=4, kv_heads=2)
KEY_RATIO = 0.05


def recipes(folders: list[Path]) -> dict[str, dict[str, Any]]:
    """The task-arithmetic recipe (ours, and mergekit's float32 form of it) and MAEC's."""
    base, ability, lang = folders
    ta: dict[str, Any] = {
        "merge_method": "task_arithmetic", "base_model": str(base),
        "models": [{"model": str(ability), "parameters": {"weight": 1.0}},
                   {"model": str(lang), "parameters": {"weight": 1.0}}],
    }
    return {
        "ta": {**ta, "dtype": "bfloat16"},
        # mergekit computes in its recipe's dtype: float32 as ours, bf16 written out.
        "mergekit": {**ta, "dtype": "float32", "out_dtype": "bfloat16"},
        "maec": {"merge_method": "maec", "base_model": str(base), "language_base": str(lang),
                 "abilities": [{"model": str(ability), "name": "ability"}],
                 "parameters": {"key_ratio": KEY_RATIO, "importance": "delta"},
                 "dtype": "bfloat16"},
    }


def child(mode: str, device: str, recipe_path: Path, out: Path) -> None:
    """One measured merge in this process: ``mode`` ta or maec on ``device``."""
    from maec_core.artifact_store import LocalArtifactStore
    from maec_core.parsing import parse_recipe
    from maec_core.run import run

    parsed = parse_recipe(yaml.safe_load(recipe_path.read_text()))
    hash_cache = Path(os.environ["MAEC_CACHE_DIR"]) / "sha256"
    shutil.rmtree(out, ignore_errors=True)
    # MAEC with an empty store: every run extracts, as a first job with this donor does.
    store = LocalArtifactStore(out.with_name(out.name + ".store")) if mode == "maec" else None
    try:
        run(parsed, out, RunContext(device=device, artifact_store=store, hash_cache=hash_cache))
    finally:
        if store is not None:
            shutil.rmtree(store.root, ignore_errors=True)


def compare(got: Path, want: Path) -> str:
    """``bit-identical``, or the largest absolute difference and how many tensors differ."""
    import torch
    from safetensors import safe_open

    def index(folder: Path) -> dict[str, Path]:
        out: dict[str, Path] = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                out.update(dict.fromkeys(h.keys(), f))
        return out

    a, b = index(got), index(want)
    if a.keys() != b.keys():
        return f"different tensor names ({len(a)} vs {len(b)})"
    worst, differ = 0.0, 0
    for name in sorted(a):
        with safe_open(str(a[name]), "pt") as ha, safe_open(str(b[name]), "pt") as hb:
            x, y = ha.get_tensor(name), hb.get_tensor(name)
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"{name}: {x.dtype} {list(x.shape)} vs {y.dtype} {list(y.shape)}"
        # Bytes, not values: -0.0 and 0.0 compare equal as numbers.
        if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            differ += 1
            worst = max(worst, float((x.float() - y.float()).abs().max()))
    if not differ:
        return "bit-identical"
    return f"{differ} of {len(a)} tensors differ, largest difference {worst:.3g}"


def outputs(work: Path, name: str) -> list[Path]:
    """What command ``name`` writes (removed before each of its runs)."""
    return [work / "floor.bin"] if name == "floor" else [work / f"out-{name}"]


def commands(work: Path, folders: list[Path], gpu: str, dry: bool) -> dict[str, list[str]]:
    paths = {k: work / f"{k}.yaml" for k in ("ta", "mergekit", "maec")}
    for k, doc in recipes(folders).items():
        paths[k].write_text(yaml.safe_dump(doc, sort_keys=False))
    me = [sys.executable, "-m", "bench.gpu", "--child"]
    mergekit = [str(VENV_BIN / "mergekit-yaml"), str(paths["mergekit"]),
                str(work / "out-mergekit-cuda")]
    out_bytes = folder_bytes(folders[0])
    return {
        "ta-cuda": [*me, "ta", gpu, str(paths["ta"]), str(work / "out-ta-cuda")],
        "ta-cpu": [*me, "ta", "cpu", str(paths["ta"]), str(work / "out-ta-cpu")],
        "maec-cuda": [*me, "maec", gpu, str(paths["maec"]), str(work / "out-maec-cuda")],
        "maec-cpu": [*me, "maec", "cpu", str(paths["maec"]), str(work / "out-maec-cpu")],
        "mergekit-cuda": mergekit if dry else [*mergekit, "--cuda"],
        "floor": io_floor_cmd(folders, work / "floor.bin", out_bytes),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.gpu")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shape, the 'cuda' legs on the CPU: checks the harness")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--child", nargs=4, metavar=("MODE", "DEVICE", "RECIPE", "OUT"))
    args = ap.parse_args(argv)
    if args.child:
        mode, device, recipe, out = args.child
        child(mode, device, Path(recipe), Path(out))
        return 0
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("bench-gpu: no CUDA device on this machine; nothing measured "
              "(--dry-run checks the harness on the CPU)")
        return 0
    shape, gpu = (TINY, "cpu") if args.dry_run else (FULL, "cuda")
    work = args.work or (Path(tempfile.mkdtemp(prefix="maec-bench-gpu-")) if args.dry_run
                         else CACHE / "gpu")
    work.mkdir(parents=True, exist_ok=True)
    folders = [work / "models" / n for n in ("base", "ability", "lang")]
    if not all((f / "config.json").is_file() for f in folders):
        print(f"bench-gpu: building 3 checkpoints of {shape.params() / 1e9:.3f}B params "
              f"(bf16) under {work / 'models'}", flush=True)
        build_family(folders, shape)
    code = measure_all(work, folders, gpu, args.runs, args.dry_run)
    if args.dry_run and args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return code


def measure_all(work: Path, folders: list[Path], gpu: str, runs: int, dry: bool) -> int:
    cmds = commands(work, folders, gpu, dry)
    env = {"MAEC_CACHE_DIR": str(work / "hash-cache")}

    def run(name: str) -> Measured:
        for out in outputs(work, name):
            shutil.rmtree(out, ignore_errors=True)
            out.unlink(missing_ok=True)
        return measure(cmds[name], env=env)

    if not dry:
        for name in cmds:  # warm-up, not counted: page cache, input digests, CUDA context
            print(f"warm-up {name}: {run(name).wall:.2f} s", flush=True)
    results = interleaved(list(cmds), runs, run)
    med = {k: median([m.wall for m in v]) for k, v in results.items()}
    # Each leg's last outputs are still there: the GPU's against the CPU's.
    for leg in ("ta", "maec"):
        check = compare(work / f"out-{leg}-cuda", work / f"out-{leg}-cpu")
        print(f"bench-gpu: {leg} on {gpu} vs on cpu: {check}", flush=True)
    for name, wall in med.items():
        print(f"bench-gpu: {name:14s} median wall {wall:7.2f} s")
    print(f"bench-gpu: speed-up on {gpu}: task arithmetic "
          f"{med['ta-cpu'] / med['ta-cuda']:.2f}x, MAEC {med['maec-cpu'] / med['maec-cuda']:.2f}x")
    print(f"RESULT gpu wall_ratio_vs_mergekit_cuda={med['ta-cuda'] / med['mergekit-cuda']:.3f} "
          f"wall_ratio_vs_floor={med['ta-cuda'] / med['floor']:.3f} "
          f"maec_full_vs_ta={med['maec-cuda'] / med['ta-cuda']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
