"""The compiled row-score kernel gives torch's float32 sums bit for bit, on every dtype,
shape class (rows and widths around its blocks of 8) and value class; without it (not
built, or ``MAEC_NATIVE=0``) row scores come from torch, the same numbers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from maec_core import native
from maec_core.maec import extract

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="the native kernel is not built (no C compiler)")

SHAPES = [(0, 5), (1, 1), (3, 7), (7, 8), (8, 8), (9, 9), (8, 15), (16, 16), (17, 33),
          (5, 4096), (64, 4103), (24, 11008)]


def _torch_scores(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(a.float() - b.float(), 1, dim=1)


def _pair(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> tuple[torch.Tensor,
                                                                            torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Magnitudes over ten orders, so the order of the additions shows in the last bits.
    scale = torch.logspace(-6, 4, max(shape[1], 1))[:shape[1]]
    a = torch.randn(shape, generator=g) * scale
    b = a + torch.randn(shape, generator=g) * scale * 1e-2
    return a.to(dtype), b.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_equals_torch_bit_for_bit(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    for seed in range(3):
        a, b = _pair(shape, dtype, seed)
        got = native.l1_rows(a, b)
        if got is None:
            # float16 needs the AVX2 + F16C path; elsewhere torch serves it.
            assert dtype == torch.float16
            continue
        assert torch.equal(got, _torch_scores(a, b)), (dtype, shape, seed)


def test_special_values_follow_torch() -> None:
    a = torch.tensor([[1.0, float("inf"), 2.0] + [0.5] * 13,
                      [float("nan")] + [1.0] * 15,
                      [-0.0] * 16,
                      [3.4e38, -3.4e38] + [0.0] * 14] * 3)
    b = torch.zeros_like(a)
    b[0, 1] = float("inf")
    for dtype in (torch.float32, torch.bfloat16):
        x, y = a.to(dtype), b.to(dtype)
        got = native.l1_rows(x, y)
        assert got is not None
        assert torch.equal(got.isnan(), _torch_scores(x, y).isnan())
        ok = ~got.isnan()
        assert torch.equal(got[ok], _torch_scores(x, y)[ok])


def test_what_it_cannot_take_is_left_to_torch() -> None:
    a, b = _pair((8, 16), torch.bfloat16, 0)
    assert native.l1_rows(a, b.float()) is None  # dtypes differ
    assert native.l1_rows(a.t(), b.t()) is None  # not contiguous
    assert native.l1_rows(a.double(), b.double()) is None  # no float64 path


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_scores_are_the_same_with_and_without_it(dtype: torch.dtype,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _pair((40, 4103), dtype, 1)
    fast = extract.row_scores(a, b)
    monkeypatch.setattr(extract, "native_l1_rows", lambda x, y: None)
    assert torch.equal(fast, extract.row_scores(a, b))


def test_maec_native_0_turns_it_off() -> None:
    code = ("from maec_core import native; import torch; "
            "a = torch.ones(8, 8); print(native.available(), native.l1_rows(a, a))")
    out = subprocess.run([sys.executable, "-c", code], env={"MAEC_NATIVE": "0",
                                                             "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "None"]
