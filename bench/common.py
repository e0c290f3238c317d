"""Shared benchmark helpers: synthetic Llama checkpoints, measured child runs, medians.

Benchmarks compare against a peer measured in the same run, interleaved, so the noise of
a shared machine hits both sides alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
import yaml

from maec_core.io.writer import OutputTensor, ShardedWriter

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "bench" / "cache"
# The tools installed next to the interpreter running the benchmark (the project venv).
VENV_BIN = Path(sys.executable).parent

# Runs COMMAND, then reports its wall time and the peak RSS of it and everything it
# waited for. A fresh wrapper per run, because RUSAGE_CHILDREN only ever grows within
# one process (its ru_maxrss is a max over all children ever reaped).
_MEASURE = r"""
import json, resource, subprocess, sys, time
t0 = time.perf_counter()
proc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
wall = time.perf_counter() - t0
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
rss = usage.ru_maxrss * 1024
print(json.dumps({"wall": wall, "rss": rss, "cpu": usage.ru_utime + usage.ru_stime,
                  "rc": proc.returncode,
                  "err": proc.stderr.decode(errors="replace")[-2000:]}))
"""


@dataclass(frozen=True)
class Measured:
    wall: float
    rss: int
    # User plus system CPU seconds of the command and its children: on a shared machine
    # steadier than wall time (another session's load stretches wall time, not these).
    cpu: float = 0.0


def measure(cmd: Sequence[str], env: dict[str, str] | None = None) -> Measured:
    """Run ``cmd`` in a fresh wrapper; its wall seconds and peak RSS in bytes."""
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, *cmd], capture_output=True, text=True, check=True,
        env={**os.environ, **(env or {})},
    )
    doc = json.loads(out.stdout)
    if doc["rc"] != 0:
        raise RuntimeError(f"{cmd[0]} failed ({doc['rc']}):\n{doc['err']}")
    return Measured(doc["wall"], doc["rss"], doc.get("cpu", 0.0))


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def model_bench_parser(doc: str | None) -> argparse.ArgumentParser:
    """The options of a benchmark over synthetic checkpoints: ``--runs`` and ``--small``."""
    ap = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="tiny models, harness check only")
    return ap


def write_ta_recipe(folders: Sequence[Path], path: Path, **fields: str) -> Path:
    """A task-arithmetic recipe of ``folders`` (the base first, each other one weighted
    0.5) written to ``path``; ``fields`` are its top-level fields after ``models``
    (default: dtype bfloat16)."""
    base, *donors = folders
    doc = {
        "merge_method": "task_arithmetic",
        "base_model": str(base),
        "models": [{"model": str(d), "parameters": {"weight": 0.5}} for d in donors],
        **(fields or {"dtype": "bfloat16"}),
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def fresh_dir(path: Path) -> Path:
    """``path``, created empty (what an earlier run left there is removed)."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def free_memory() -> int:
    """Bytes of memory the kernel holds free, the page cache not counted (Linux's
    ``MemFree``)."""
    return int(psutil.virtual_memory().free)


def prime_pages(path: Path, size: int) -> int:
    """Write ``size`` bytes (in whole 8 MiB blocks) to ``path`` and delete it; at most the
    free memory less 1 GiB, so no page cache is evicted. Returns the bytes written.

    On a VM whose balloon reports free pages to its host (this machine's does), memory
    left free for a couple of seconds is handed back, and the next first touch of each of
    its pages stalls on the host. Writing a 1.7 GB file here takes 3.3-4.7 s of system
    time after 8 s idle, and 0.32-0.38 s just after another 1.7 GB file was deleted. A
    command run right after this finds the pages it writes into backed, as on bare metal,
    whatever ran before it."""
    size = min(size, free_memory() - 2**30)
    if size <= 0:
        return 0
    block = bytes(8 << 20)
    written = 0
    with path.open("wb") as f:
        while written < size:
            written += f.write(block)
    path.unlink()
    return written


def measured_runs(commands: Mapping[str, Sequence[str]], env: dict[str, str],
                  scratch: Sequence[Path], prime: int = 0) -> Callable[[str], Measured]:
    """``run(name)``: ``measure`` the command called ``name``, with the files and folders
    it writes (``scratch``) removed before and after, so every run writes from nothing and
    no run's output fills the disk or the page cache for the next. ``prime``: bytes that
    ``prime_pages`` writes and deletes next to the first scratch path before every run,
    untimed, the same for every command (0: none)."""

    def clear() -> None:
        for p in scratch:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    def run(name: str) -> Measured:
        clear()
        if prime:
            prime_pages(scratch[0].parent / "prime.bin", prime)
        try:
            return measure(commands[name], env=env)
        finally:
            clear()

    return run


def print_medians(results: Mapping[str, Sequence[Measured]]) -> dict[str, tuple[float, float]]:
    """Print each command's median wall seconds and peak RSS; return them by name."""
    width = max(len(k) for k in results)
    med = {k: (median([m.wall for m in v]), median([m.rss for m in v]))
           for k, v in results.items()}
    for k, (w, r) in med.items():
        cpu = median([m.cpu for m in results[k]])
        print(f"median {k:{width}s}    wall {w:6.2f} s  rss {r / 1e9:5.2f} GB  "
              f"cpu {cpu:6.2f} s")
    return med


def interleaved(names: Sequence[str], runs: int,
                run: Callable[[str], Measured]) -> dict[str, list[Measured]]:
    """``runs`` rounds of every command, the order rotated each round, so drift in the
    machine's load (or page cache) does not favour whichever command goes first."""
    results: dict[str, list[Measured]] = {k: [] for k in names}
    order = list(names)
    width = max(len(k) for k in order)
    for i in range(runs):
        shift = i % len(order)
        for name in order[shift:] + order[:shift]:
            m = run(name)
            results[name].append(m)
            print(f"run {i + 1} {name:{width}s}   wall {m.wall:6.2f} s  "
                  f"rss {m.rss / 1e9:5.2f} GB  cpu {m.cpu:6.2f} s", flush=True)
    return results


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        h, kv = self.hidden, self.hidden // self.heads * self.kv_heads
        yield "model.embed_tokens.weight", (self.vocab, h)
        for i in range(self.layers):
            p = f"model.layers.{i}."
            yield p + "input_layernorm.weight", (h,)
            yield p + "mlp.down_proj.weight", (h, self.intermediate)
            yield p + "mlp.gate_proj.weight", (self.intermediate, h)
            yield p + "mlp.up_proj.weight", (self.intermediate, h)
            yield p + "post_attention_layernorm.weight", (h,)
            yield p + "self_attn.k_proj.weight", (kv, h)
            yield p + "self_attn.o_proj.weight", (h, h)
            yield p + "self_attn.q_proj.weight", (h, h)
            yield p + "self_attn.v_proj.weight", (kv, h)
        yield "model.norm.weight", (h,)
        yield "lm_head.weight", (self.vocab, h)

    def params(self) -> int:
        total = 0
        for _, shape in self.tensors():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    def config(self) -> dict[str, object]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "vocab_size": self.vocab,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "dtype": "bfloat16",
            "torch_dtype": "bfloat16",
        }


def build_family(folders: Sequence[Path], shape: LlamaShape, *, seed: int = 0,
                 noise: float = 0.002, shard_size: str = "1GB") -> None:
    """Write a bf16 base (``folders[0]``) and fine-tunes of it (the rest), streaming.

    Each tensor is drawn once from a generator seeded by its name, written to the base,
    then perturbed per donor; nothing but one tensor is ever in memory, and a few seconds
    per GB instead of instantiating and saving a transformers model.
    """
    from maec_core.recipe import parse_size
    from maec_core.runtime import torch_threads

    # One thread: on a shared machine an OpenMP team stalls at every op's barrier
    # (measured 10x slower for this loop on 2 busy cores); the work is I/O-bound anyway.
    with torch_threads(1):
        _build(folders, shape, seed, noise, parse_size(shard_size))


def _build(folders: Sequence[Path], shape: LlamaShape, seed: int, noise: float,
           shard_size: int) -> None:
    specs = [OutputTensor(n, s, "BF16") for n, s in shape.tensors()]
    tmp = [f.with_name(f.name + ".partial") for f in folders]
    for t in tmp:
        shutil.rmtree(t, ignore_errors=True)
        t.mkdir(parents=True)
    writers = [ShardedWriter(t, specs, shard_size) for t in tmp]
    for name, dims in shape.tensors():
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        # Norm weights start at one, as in a real checkpoint; matrices ~ N(0, 0.02²).
        is_norm = len(dims) == 1
        base = torch.ones(dims) if is_norm else torch.randn(dims, generator=gen).mul_(0.02)
        writers[0].write(name, base.to(torch.bfloat16))
        for w in writers[1:]:
            donor = torch.randn(dims, generator=gen).mul_(noise).add_(base)
            w.write(name, donor.to(torch.bfloat16))
            del donor
        del base
    for w, t, final in zip(writers, tmp, folders, strict=True):
        w.close()
        (t / "config.json").write_text(json.dumps(shape.config(), indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.rename(t, final)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def io_phases_cmd(phases: Sequence[Sequence[Path]], out_file: Path, out_bytes: int
                  ) -> list[str]:
    """A command that reads the weight files of each phase's folders, one phase after
    the other, writing ``out_bytes`` to ``out_file`` on a second thread during the last.

    The I/O of a merge without its math or hashing: task arithmetic reads its three inputs
    while its output is written (one phase); MAEC must read θ0 and θA in full before any
    output byte is known, then reads θL while writing (two phases). On a disk that reads
    and writes together faster than it reads alone, the second order costs more; timing
    both says whether this disk is one. Plain Python file I/O in 16 MB blocks through one
    buffer (its bytes do not matter), no math, no hashing, no fsync.
    """
    groups = [[str(p) for f in phase for p in sorted(f.glob("*.safetensors"))]
              for phase in phases]
    code = (
        "import json, sys, threading\n"
        "out, size, groups = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])\n"
        "buf = bytearray(16 << 20)\n"
        "view = memoryview(buf)\n"
        "def read(files):\n"
        "    for name in files:\n"
        "        with open(name, 'rb', buffering=0) as f:\n"
        "            while f.readinto(buf):\n"
        "                pass\n"
        "def write():\n"
        "    with open(out, 'wb', buffering=0) as f:\n"
        "        left = size\n"
        "        while left:\n"
        "            left -= f.write(view[:min(left, len(buf))])\n"
        "for files in groups[:-1]:\n"
        "    read(files)\n"
        "w = threading.Thread(target=write)\n"
        "w.start()\n"
        "read(groups[-1])\n"
        "w.join()\n"
    )
    return [sys.executable, "-c", code, str(out_file), str(out_bytes), json.dumps(groups)]


def io_floor_cmd(inputs: Sequence[Path], out_file: Path, out_bytes: int) -> list[str]:
    """A command that reads every input file once and writes ``out_bytes`` to ``out_file``.

    The least any merge must do: plain Python file I/O in 16 MB blocks, no math, no
    hashing, no fsync (neither engine syncs).
    """
    # Every read first, then the write beside an empty last phase.
    return io_phases_cmd([inputs, []], out_file, out_bytes)
