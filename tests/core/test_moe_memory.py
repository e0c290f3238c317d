"""An MoE build's peak memory stays at a few tensors, whatever the model size.

As ``test_engine_memory``: a fresh subprocess builds a Mixtral from a base and two
experts and reports its peak resident set (reset after the imports); the same build
from 4x deeper models (same tensor shapes, ~70 MB more input) must
peak at nearly the same RSS. A builder that held a model, or an expert's layers, would
grow by tens of MB here. The ``random`` gate mode runs no model (the ``hidden`` modes
run the base on the prompts, as mergekit-moe does: docs/moe.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import LlamaShape, build_family, folder_bytes

pytestmark = pytest.mark.slow

SMALL = LlamaShape(hidden=128, layers=16, intermediate=512, vocab=512, heads=4, kv_heads=2)
LARGE = LlamaShape(hidden=128, layers=64, intermediate=512, vocab=512, heads=4, kv_heads=2)

_CHILD = r"""
import json, sys
from maec_core.moe.build import build_moe
from maec_core.moe.config import parse_moe_config

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
build_moe(parse_moe_config(json.loads(sys.argv[1])), sys.argv[2])
with open("/proc/self/status") as f:
    print([int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:")][0])
"""


def peak_rss(folders: list[Path], out: Path) -> int:
    base, *experts = folders
    config = {"base_model": str(base), "gate_mode": "random",
              "experts": [{"source_model": str(e)} for e in experts]}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(config), str(out)],
        capture_output=True, text=True, check=True,
        env={"MAEC_CACHE_DIR": str(out.parent / "hash-cache"), "PATH": "/usr/bin:/bin"},
        cwd=Path(__file__).resolve().parents[2])
    return int(proc.stdout.strip().splitlines()[-1])


def test_moe_peak_rss_does_not_grow_with_model_size(tmp_path: Path) -> None:
    families = {}
    for tag, shape in (("small", SMALL), ("large", LARGE)):
        folders = [tmp_path / tag / n for n in ("base", "e1", "e2")]
        build_family(folders, shape, shard_size="10MB")
        families[tag] = folders
    extra = (sum(folder_bytes(f) for f in families["large"])
             - sum(folder_bytes(f) for f in families["small"]))
    assert extra > 60e6
    small = peak_rss(families["small"], tmp_path / "out-small")
    large = peak_rss(families["large"], tmp_path / "out-large")
    assert large - small < extra / 8, (
        f"peak RSS {small / 1e6:.1f} MB -> {large / 1e6:.1f} MB when the inputs grew by "
        f"{extra / 1e6:.0f} MB")
