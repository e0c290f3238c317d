"""The compiled task-arithmetic kernel gives the bytes of the method's torch steps, for
every input, compute and output dtype, any number of models it takes, normalize and λ,
special values (signed zeros, subnormals, values that overflow float16) and lengths
around its blocks of 8; the engine's stream uses it and writes the same files as
without it."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

import maec_core.native as native
from maec_core.methods import get_method
from maec_core.methods.base import TensorCall
from maec_core.methods.task_arithmetic import TaskArithmeticModelParams as ModelParams
from maec_core.methods.task_arithmetic import TaskArithmeticParams
from maec_core.parsing import parse_recipe
from maec_core.run import run

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="the native kernel is not built (no C compiler)")

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
# (stored, compute, output) dtypes: the recipes' own first, then conversions each way.
DTYPES = [(BF16, BF16, BF16), (F16, F16, F16), (BF16, F32, BF16), (F16, F32, F16),
          (F32, F32, F32), (F32, BF16, BF16), (F32, F16, F16), (BF16, BF16, F32),
          (BF16, BF16, F16), (F16, BF16, BF16), (F32, F32, BF16)]
SPECIAL = [0.0, -0.0, 1e-40, -1e-40, 6e4, -6e4, 1e-7, 65504.0, 3e38, -3e38]


def _inputs(n: int, dtype: torch.dtype, count: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        # Magnitudes over many orders, so every rounding step shows in the last bits.
        x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)
        x[: min(n, len(SPECIAL))] = torch.tensor(SPECIAL)[: min(n, len(SPECIAL))]
        out.append(x.to(dtype))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _torch_and_kernel(xs: list[torch.Tensor], weights: list[float], params: TaskArithmeticParams,
                      compute: torch.dtype, out_dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor, bool | None]:
    method = get_method("task_arithmetic")
    mps = [ModelParams(weight=w) for w in weights]
    # The engine's torch path: private copies in the compute dtype, merged, cast.
    copies = [x.to(compute, copy=True) for x in xs]
    want = method.merge(TensorCall("t", copies[0], copies[1:], mps, params, None, 1))
    got = torch.empty(xs[0].numel(), dtype=out_dtype)
    finite = method.merge_into(TensorCall("t", xs[0], xs[1:], mps, params, None, 1), got,
                               compute)
    return want.to(out_dtype), got, finite


@pytest.mark.parametrize(("stored", "compute", "out_dtype"), DTYPES)
def test_kernel_gives_the_torch_steps_bytes(stored: torch.dtype, compute: torch.dtype,
                                            out_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    cases = itertools.product([1, 2, 3, 16], [False, True], [1.0, 0.7, -1.3], [False, True])
    for i, (models, normalize, lam, ones) in enumerate(cases):
        weights = ([1.0] * models if ones
                   else (torch.rand(models, generator=g) * 2 - 0.5).tolist())
        params = TaskArithmeticParams(normalize=normalize, **{"lambda": lam})
        xs = _inputs(1003, stored, models + 1, seed=i)
        want, got, finite = _torch_and_kernel(xs, weights, params, compute, out_dtype)
        case = (models, normalize, lam, weights)
        assert finite is not None, case
        ok = torch.isfinite(want)
        # Where torch's result is finite, the same bits; elsewhere non-finite too (a NaN's
        # payload is nobody's business: such a merge fails).
        assert torch.equal(ok, torch.isfinite(got)), case
        assert torch.equal(_bits(want)[ok], _bits(got)[ok]), case
        assert finite == bool(ok.all()), case


@pytest.mark.parametrize("n", [1, 7, 8, 9, 15, 17])
def test_lengths_around_the_blocks(n: int) -> None:
    xs = _inputs(n, BF16, 3, seed=n)
    want, got, finite = _torch_and_kernel(xs, [0.6, 0.4], TaskArithmeticParams(), BF16, BF16)
    assert finite is not None
    assert torch.equal(_bits(want), _bits(got))


def test_declines_what_it_cannot_take() -> None:
    """More than 16 models (torch groups its 16-bit sum), or inputs of two dtypes: out
    untouched, the caller uses torch."""
    method = get_method("task_arithmetic")
    many = _inputs(64, BF16, 18, seed=1)
    out = torch.full((64,), 5.0, dtype=BF16)
    call = TensorCall("t", many[0], many[1:], [ModelParams()] * 17, TaskArithmeticParams(),
                      None, 1)
    assert method.merge_into(call, out, BF16) is None
    mixed = [many[0], many[1].float()]
    call = TensorCall("t", mixed[0], mixed[1:], [ModelParams()], TaskArithmeticParams(),
                      None, 1)
    assert method.merge_into(call, out, F32) is None
    assert bool((out == 5.0).all())


def test_non_finite_results_are_reported() -> None:
    base = torch.zeros(20, dtype=F16)
    big = torch.full((20,), 60000.0, dtype=F16)
    out = torch.empty(20, dtype=F16)
    method = get_method("task_arithmetic")
    call = TensorCall("t", base, [big], [ModelParams()],
                      TaskArithmeticParams(**{"lambda": 2.0}), None, 1)
    # 120000 overflows float16: in the arithmetic, or in the cast of the float32 result.
    assert method.merge_into(call, out, F16) is False
    assert method.merge_into(call, out, F32) is False
    call = TensorCall("t", base, [big], [ModelParams()], TaskArithmeticParams(), None, 1)
    assert method.merge_into(call, out, F16) is True


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_engine_writes_the_same_files_with_and_without_it(
    bf16_zoo: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str,
) -> None:
    recipe = parse_recipe({
        "merge_method": "task_arithmetic", "base_model": str(bf16_zoo["base"]),
        "models": [{"model": str(bf16_zoo["a"]), "parameters": {"weight": 0.7}},
                   {"model": str(bf16_zoo["b"]), "parameters": {"weight": 0.45}}],
        "parameters": {"normalize": True, "lambda": 0.9}, "dtype": dtype,
    })
    used: list[bool | None] = []
    kernel = native.task_arithmetic

    def spied(*args: object) -> bool | None:
        used.append(kernel(*args))  # type: ignore[arg-type]
        return used[-1]

    monkeypatch.setattr(native, "task_arithmetic", spied)
    run(recipe, tmp_path / "fused")
    assert used and all(u is True for u in used)
    monkeypatch.setattr(native, "_library", lambda: None)
    used.clear()
    run(recipe, tmp_path / "torch")
    assert used == [None] * len(used)
    assert ((tmp_path / "fused" / "model.safetensors").read_bytes()
            == (tmp_path / "torch" / "model.safetensors").read_bytes())
