"""SLERP streamed in 16 bits: its reductions over slices give the whole tensor's bytes.

mergekit 0.1.5 reduces SLERP's norms and dot over chunks of 1M entries; the tiny models
of the conformance suite fit in one, so here the chunk is made small and every slice
boundary falls inside a chunk, against the whole-tensor function (which the conformance
suite checks against mergekit itself).
"""

from __future__ import annotations

import pytest
import torch

import maec_core.methods.slerp as slerp_module
from maec_core.methods.base import TensorCall
from maec_core.methods.slerp import SlerpParams, SlerpPass, interpolate, slerp

CHUNK, SLICE, N = 100, 77, 1000


def _streamed(v0: torch.Tensor, v1: torch.Tensor, compute: torch.dtype, t: float
              ) -> torch.Tensor:
    first = SlerpPass(compute, t, 1e-8)
    rounds = 0
    while True:
        for i in range(0, N, SLICE):
            first.add(v0[i:i + SLICE], [v1[i:i + SLICE]])
        coefs = first.finish()
        rounds += 1
        if not first.again():
            break
    assert rounds == 2 and coefs is not None
    out = []
    for i in range(0, N, SLICE):
        call = TensorCall("w", v0[i:i + SLICE].to(compute), [v1[i:i + SLICE].to(compute)],
                          [None], SlerpParams(t=t), None, 1, reduced=coefs)
        out.append(interpolate(call, coefs))
    return torch.cat(out)


@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["random", "parallel", "zero"])
def test_slices_give_the_whole_tensors_bytes(compute: torch.dtype, case: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slerp_module, "_MERGEKIT_CHUNK", CHUNK)
    gen = torch.Generator().manual_seed(3)
    # Stored in float32: the passes round to the compute dtype first, as the engine's
    # whole-tensor path does on reading.
    v0 = torch.randn(N, generator=gen)
    v1 = {"random": torch.randn(N, generator=gen),
          "parallel": v0 * 1.5 + 1e-3 * torch.randn(N, generator=gen),  # linear branch
          "zero": torch.zeros(N)}[case]
    v0[CHUNK - 1] = float("1e-9")
    whole = slerp(v0.to(compute), v1.to(compute), 0.3, 1e-8)
    got = _streamed(v0, v1, compute, 0.3)
    assert got.dtype == whole.dtype == compute
    assert torch.equal(got.view(torch.int16), whole.view(torch.int16))



def test_an_empty_tensor_goes_whole() -> None:
    first = SlerpPass(torch.bfloat16, 0.5, 1e-8)
    first.add(torch.zeros(0), [torch.zeros(0)])
    assert first.finish() is None and not first.again()
