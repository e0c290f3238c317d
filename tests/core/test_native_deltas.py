"""The compiled task-arithmetic and linear kernels give the bytes of the methods' torch
steps, for every input, compute and output dtype, any number of models they take,
normalize, λ and weights, special values (signed zeros, subnormals, values that overflow
float16) and lengths around their blocks of 8; the engine's stream uses them and writes
the same files as without them."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

import maec_core.native as native
from maec_core.methods import get_method
from maec_core.methods._common import WeightParams
from maec_core.methods.base import TensorCall
from maec_core.methods.linear import LinearParams
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
    cases = itertools.product([1, 2, 3, 4, 5, 16], [False, True], [1.0, 0.7, -1.3],
                              [False, True])
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


@pytest.mark.parametrize(("stored", "compute", "out_dtype"), DTYPES)
def test_linear_kernel_gives_the_torch_steps_bytes(stored: torch.dtype, compute: torch.dtype,
                                                   out_dtype: torch.dtype) -> None:
    method = get_method("linear")
    g = torch.Generator().manual_seed(9)
    cases = itertools.product([1, 2, 3, 8], [False, True], [False, True],
                              ["random", "ones", "cancel"], [5, 1003])
    for i, (models, normalize, with_base, weighting, n) in enumerate(cases):
        weights = {"random": (torch.rand(models, generator=g) * 2 - 0.5).tolist(),
                   "ones": [1.0] * models,
                   # Weights summing to 0 (with the base's 1): the plain sum is kept.
                   "cancel": ([-1.0] + [0.0] * models)[:models] if with_base
                   else ([0.5, -0.5] * models)[:models]}[weighting]
        xs = _inputs(n, stored, models + with_base, seed=100 + i)
        mps = [WeightParams(weight=w) for w in weights]
        params = LinearParams(normalize=normalize)

        def call(ts: list[torch.Tensor], mps: list[WeightParams] = mps,
                 params: LinearParams = params, with_base: bool = with_base) -> TensorCall:
            return TensorCall("t", ts[0] if with_base else None, ts[1:] if with_base else ts,
                              mps, params, None, 1)

        want = method.merge(call([x.to(compute, copy=True) for x in xs])).to(out_dtype)
        got = torch.empty(n, dtype=out_dtype)
        finite = method.merge_into(call(xs), got, compute)
        case = (models, normalize, with_base, weights, n)
        assert finite is not None, case
        ok = torch.isfinite(want)
        assert torch.equal(ok, torch.isfinite(got)), case
        assert torch.equal(_bits(want)[ok], _bits(got)[ok]), case
        assert finite == bool(ok.all()), case


def test_addcmul_probe_answers_for_this_torch() -> None:
    """The linear kernel follows torch's addcmul rounding, which the probe reads off: a
    fused multiply-add or two roundings, the same on its vector and scalar loops."""
    assert native._addcmul_fuses() is not None


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


@pytest.mark.parametrize("at", [0, 5, 16, 31, 40, 63])
@pytest.mark.parametrize("value", [3e38, -3e38, float("nan")])
def test_a_non_finite_entry_anywhere_is_reported(at: int, value: float) -> None:
    """bfloat16 end to end tests what it stores once per 16 packed entries: an inf or NaN
    result at any position of the blocks (or of the tail) fails the call, of either
    sign; the same inputs without it pass."""
    method = get_method("task_arithmetic")
    base, a, b = (torch.full((64,), 0.25, dtype=BF16) for _ in range(3))
    call = TensorCall("t", base, [a, b], [ModelParams(weight=0.5)] * 2,
                      TaskArithmeticParams(), None, 1)
    out = torch.empty(64, dtype=BF16)
    assert method.merge_into(call, out, BF16) is True
    # 3e38 − (−3e38) overflows float32 (a NaN stays one).
    a[at], b[at], base[at] = value, value, -value
    assert method.merge_into(call, out, BF16) is False
    assert not bool(torch.isfinite(out[at]))
    assert bool(torch.isfinite(torch.cat([out[:at], out[at + 1:]])).all())


@pytest.mark.parametrize(("stored", "pattern"), [(F32, 0x7FFFFFFF), (F32, -1), (F16, 0x7FFF),
                                                 (BF16, 0x7FFF), (BF16, -1)])
@pytest.mark.parametrize("method", ["task_arithmetic", "linear"])
def test_nan_inputs_never_round_to_a_number(stored: torch.dtype, pattern: int,
                                            method: str) -> None:
    """A NaN whose payload fills the low bits (the carry of rounding to bfloat16 could
    make it -0.0 or +0.0) still fails the merge, in every compute dtype."""
    ints = {F32: torch.int32, F16: torch.int16, BF16: torch.int16}[stored]
    nan = torch.tensor([pattern] * 11, dtype=ints).view(stored)
    assert bool(torch.isnan(nan).all())
    zeros = torch.zeros(11, dtype=stored)
    spec = get_method(method)
    params = TaskArithmeticParams() if method == "task_arithmetic" else LinearParams()
    for inputs in ([zeros, nan], [nan, zeros]):
        call = TensorCall("t", inputs[0], inputs[1:], [WeightParams(weight=0.5)], params,
                          None, 1)
        for compute in (BF16, F16, F32):
            out = torch.empty(11, dtype=BF16)
            assert spec.merge_into(call, out, compute) is False, (inputs, compute)
            assert bool(torch.isnan(out).all())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("method", ["task_arithmetic", "linear"])
def test_engine_writes_the_same_files_with_and_without_it(
    bf16_zoo: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str,
    method: str,
) -> None:
    recipe = parse_recipe({
        "merge_method": method, "base_model": str(bf16_zoo["base"]),
        "models": [{"model": str(bf16_zoo["a"]), "parameters": {"weight": 0.7}},
                   {"model": str(bf16_zoo["b"]), "parameters": {"weight": 0.45}}],
        "parameters": {"normalize": True, "lambda": 0.9} if method == "task_arithmetic"
        else {}, "dtype": dtype,
    })
    used: list[bool | None] = []
    kernel = getattr(native, method)

    def spied(*args: object) -> bool | None:
        used.append(kernel(*args))  # type: ignore[arg-type]
        return used[-1]

    monkeypatch.setattr(native, method, spied)
    run(recipe, tmp_path / "fused")
    assert used and all(u is True for u in used)
    monkeypatch.setattr(native, "_library", lambda: None)
    used.clear()
    run(recipe, tmp_path / "torch")
    assert used == [None] * len(used)
    assert ((tmp_path / "fused" / "model.safetensors").read_bytes()
            == (tmp_path / "torch" / "model.safetensors").read_bytes())
