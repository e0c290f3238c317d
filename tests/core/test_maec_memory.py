"""Peak memory does not grow with model size (the method document's last invariant).

A fresh Python process runs a full MAEC merge (extraction + combination) on a 4-layer
and on a 16-layer model built from the same 1-2 MB tensors, and reports its peak RSS
(``VmHWM``). Four times the layers add 3 × 72 MB of inputs (θ0, θA, θL); a
streaming implementation holds a few tensors whatever the depth, so the two peaks may
differ by a few tensors' worth, far below even one extra model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]
HID, INTER = 512, 1024

CHILD = r"""
import json, sys
from pathlib import Path
import torch
from maec_core.context import RunContext
from maec_core.artifact_store import LocalArtifactStore
from maec_core.parsing import parse_recipe
from maec_core.run import run
from maec_core.runtime import torch_threads
root = Path(sys.argv[1])


def hwm_kb():
    # VmHWM belongs to this exec's address space; ru_maxrss would carry over the peak of
    # the forked parent (pytest, holding the models it just built).
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])


before = hwm_kb()
recipe = {"merge_method": "maec", "base_model": str(root / "base"),
          "language_base": str(root / "lang"), "abilities": [{"model": str(root / "ability")}],
          "parameters": {"key_ratio": 0.05}}
with torch_threads(1):
    run(parse_recipe(recipe), root / "out",
        RunContext(artifact_store=LocalArtifactStore(root / "store"), device="cpu"))
after = hwm_kb()
print(json.dumps({"before_kb": before, "peak_kb": after}))
"""


def _model(path: Path, layers: int, seed: int) -> int:
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = torch.randn(HID, HID, generator=g)
        tensors[p + "self_attn.o_proj.weight"] = torch.randn(HID, HID, generator=g)
        tensors[p + "mlp.up_proj.weight"] = torch.randn(INTER, HID, generator=g)
        tensors[p + "mlp.down_proj.weight"] = torch.randn(HID, INTER, generator=g)
        tensors[p + "input_layernorm.weight"] = torch.ones(HID)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = {"model_type": "llama", "hidden_size": HID, "intermediate_size": INTER,
           "num_hidden_layers": layers}
    (path / "config.json").write_text(json.dumps(cfg))
    return sum(t.numel() * 4 for t in tensors.values())


def _peak(root: Path, layers: int) -> tuple[int, int]:
    size = 0
    for name, seed in (("base", 0), ("ability", 1), ("lang", 2)):
        size = _model(root / name, layers, seed)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(root)], cwd=ROOT, capture_output=True, text=True,
        timeout=300, env={"MAEC_CACHE_DIR": str(root / "cache"), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    return int(doc["peak_kb"]) * 1024, size


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_model_size(tmp_path: Path) -> None:
    small_peak, small_size = _peak(tmp_path / "small", 4)
    big_peak, big_size = _peak(tmp_path / "big", 16)
    growth_inputs = 3 * (big_size - small_size)  # 216 MB more input data
    largest_tensor = INTER * HID * 4  # 2 MB
    assert big_size - small_size > 70 * 2**20
    # A few tensors (inputs, prefetch, float32 copies, the one being written) of slack.
    assert big_peak - small_peak < 8 * largest_tensor, (
        f"peak RSS grew by {(big_peak - small_peak) / 2**20:.1f} MB for "
        f"{growth_inputs / 2**20:.0f} MB more inputs"
    )
