"""``make bench-gpu``'s harness, run dry on the CPU (tiny shape, "cuda" legs on the CPU)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu import compare

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_measures_every_leg_and_checks_outputs(tmp_path: Path) -> None:
    work = tmp_path / "work"
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--dry-run", "--runs", "1", "--work", str(work)],
        cwd=ROOT, capture_output=True, text=True, timeout=900, check=True)
    out = done.stdout
    for leg in ("ta-cuda", "ta-cpu", "maec-cuda", "maec-cpu", "mergekit-cuda", "floor"):
        assert re.search(rf"run 1 {leg} +wall", out), leg
    # Same device, same arithmetic: the harness's comparison must find the same bytes.
    assert "bench-gpu: ta on cpu vs on cpu: bit-identical" in out
    assert "bench-gpu: maec on cpu vs on cpu: bit-identical" in out
    result = [line for line in out.splitlines() if line.startswith("RESULT gpu ")]
    assert len(result) == 1
    values = dict(kv.split("=") for kv in result[0].split()[2:])
    assert set(values) == {"wall_ratio_vs_mergekit_cuda", "wall_ratio_vs_floor",
                           "maec_full_vs_ta"}
    assert all(float(v) > 0 for v in values.values())
    # The comparison tells different outputs apart.
    assert "tensors differ, largest difference" in compare(work / "out-ta-cuda",
                                                           work / "out-maec-cpu")


def test_without_a_gpu_it_says_so_and_exits_0() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the real benchmark would run")
    done = subprocess.run([sys.executable, "-m", "bench.gpu"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=True)
    assert "no CUDA device" in done.stdout
    assert "RESULT" not in done.stdout
