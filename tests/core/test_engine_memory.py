"""Peak memory stays at a few tensors, whatever the model size.

Measured for real: a fresh subprocess merges three checkpoints and reports its peak
resident set (VmHWM, reset after the imports). The same merge of a 4x deeper model
(same tensor shapes, ~70 MB more input) must peak at nearly the same RSS: constants
(imports, thread pools, allocator arenas) cancel, and what remains is what grows with
the model. An engine that held the model, or mapped and touched the input files (their
pages then count as resident), would grow by tens of MB here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import LlamaShape, build_family, folder_bytes

pytestmark = pytest.mark.slow

# Small tensors (the largest 128 KB in bf16), 16 or 64 layers: ~8 or ~31 MB a model.
SMALL = LlamaShape(hidden=128, layers=16, intermediate=512, vocab=512, heads=4, kv_heads=2)
LARGE = LlamaShape(hidden=128, layers=64, intermediate=512, vocab=512, heads=4, kv_heads=2)

_CHILD = r"""
import json, sys
from maec_core.context import RunContext
from maec_core.parsing import parse_recipe
from maec_core.run import run

def hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
peaks = []
for i, recipe in enumerate(json.loads(sys.argv[1])):
    # Import-time spikes (and the previous merge) would mask this merge: reset the peak
    # (Linux: "5" > clear_refs).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    run(parse_recipe(recipe), f"{sys.argv[2]}-{i}", RunContext(device="cpu"))
    peaks.append(hwm())
print(json.dumps(peaks))
"""
# task_arithmetic streams slices; ties goes through the whole-tensor path.
METHODS = ("task_arithmetic", "ties")


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    root = tmp_path_factory.mktemp("mem")
    out = {}
    for tag, shape in (("small", SMALL), ("large", LARGE)):
        folders = [root / tag / "base", root / tag / "d1", root / tag / "d2"]
        build_family(folders, shape, shard_size="10MB")
        out[tag] = folders
    return out


def peak_rss(folders: list[Path], out: Path) -> dict[str, int]:
    """Peak RSS of each method's merge of ``folders``, in one fresh process."""
    base, *donors = folders
    recipes = []
    for method in METHODS:
        donor = {"weight": 0.5, **({"density": 0.5} if method == "ties" else {})}
        recipes.append({"merge_method": method, "base_model": str(base),
                        "models": [{"model": str(d), "parameters": donor} for d in donors]})
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(recipes), str(out)],
        capture_output=True, text=True, check=True,
        env={"MAEC_CACHE_DIR": str(out.parent / "hash-cache"), "PATH": "/usr/bin:/bin"},
        cwd=Path(__file__).resolve().parents[2],
    )
    peaks = json.loads(proc.stdout.strip().splitlines()[-1])
    return dict(zip(METHODS, peaks, strict=True))


def test_peak_rss_does_not_grow_with_model_size(
    families: dict[str, list[Path]], tmp_path: Path
) -> None:
    extra = (sum(folder_bytes(f) for f in families["large"])
             - sum(folder_bytes(f) for f in families["small"]))
    assert extra > 60e6
    small = peak_rss(families["small"], tmp_path / "small")
    large = peak_rss(families["large"], tmp_path / "large")
    for method in METHODS:
        # A handful of 128 KB tensors in flight cannot account for more than a few MB;
        # the margin is allocator and page-granularity noise.
        assert large[method] - small[method] < extra / 8, (
            f"{method}: peak RSS {small[method] / 1e6:.1f} MB -> "
            f"{large[method] / 1e6:.1f} MB when the inputs grew by {extra / 1e6:.0f} MB"
        )


# One tensor far larger than a slice: the embedding and output head hold 8M entries
# each (16 MB a tensor in bf16), every other tensor a few KB.
WIDE = LlamaShape(hidden=256, layers=1, intermediate=512, vocab=32768, heads=4, kv_heads=2)
WIDE_TENSOR = 32768 * 256 * 2

_BLOCKS_CHILD = r"""
import json, sys
import maec_core.streaming as streaming
from maec_core.context import RunContext
from maec_core.parsing import parse_recipe
from maec_core.run import run

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
# Units and slices of 64K and 16K entries: 128 KB and 32 KB in bf16.
streaming.UNIT_CPU, streaming.CHUNK_CPU = 1 << 16, 1 << 14
recipe = parse_recipe(json.loads(sys.argv[1]))
growth = []
# The first run loads what the engine imports lazily; the second is measured.
for i in range(2):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS:")
    run(recipe, f"{sys.argv[2]}-{i}", RunContext(device="cpu"))
    growth.append(status("VmHWM:") - before)
print(json.dumps(growth[-1]))
"""


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("wide")
    folders = [root / "base", root / "d1", root / "d2"]
    build_family(folders, WIDE)
    return folders


@pytest.mark.parametrize(("method", "dtype"), [
    ("task_arithmetic", "bfloat16"), ("task_arithmetic", "float16"),
    # Reductions first (its norms, then its dot), in passes over units (float16 takes
    # the same passes).
    ("slerp", "bfloat16"),
])
def test_16bit_merge_memory_is_bounded_by_the_block_not_the_tensor(
    wide: list[Path], tmp_path: Path, method: str, dtype: str,
) -> None:
    """A merge computed in 16 bits streams slices like a float32 one: with 128 KB units,
    its peak memory grows by a few MB while merging 16 MB tensors (holding one whole
    tensor's inputs and result would take over 48 MB; SLERP's passes hold one of
    mergekit's 1M-entry chunks per input, 8 MB in float32)."""
    base, *donors = wide
    if method == "slerp":
        donors = donors[:1]
    recipe = {"merge_method": method, "base_model": str(base), "dtype": dtype,
              "models": [{"model": str(d), "parameters": {"weight": 0.5}} for d in donors]}
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKS_CHILD, json.dumps(recipe), str(tmp_path / "out")],
        capture_output=True, text=True, check=True,
        env={"MAEC_CACHE_DIR": str(tmp_path / "hash-cache"), "PATH": "/usr/bin:/bin"},
        cwd=Path(__file__).resolve().parents[2],
    )
    growth = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{method} {dtype}: peak RSS grew by {growth / 1e6:.1f} MB")
    assert growth < WIDE_TENSOR, (
        f"peak RSS grew by {growth / 1e6:.1f} MB merging {WIDE_TENSOR / 1e6:.0f} MB tensors")
