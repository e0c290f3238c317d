"""The compiled task-arithmetic and linear kernels give the bytes of the methods' torch
steps, for every input, compute and output dtype, any number of models they take,
normalize, λ and weights, special values (signed zeros, subnormals, values that overflow
float16) and lengths around their blocks of 8; the engine's stream uses them and writes
the same files as without them. Task arithmetic's AVX-512 loops (bfloat16 in and out)
are held to the same bytes and to its AVX2 loops' where the CPU has AVX-512."""

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
# The kernel library's SIMD level on this CPU: 2 AVX-512 F and BW, 1 AVX2 and F16C only.
_LOADED = native._library()
LEVEL = 0 if _LOADED is None else _LOADED[1]


@pytest.fixture(params=[1, 2], ids=["avx2", "avx512"])
def simd(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """The test runs once on the AVX2 loops and once on the AVX-512 ones, the library
    told to use no more than that level; skipped where the CPU lacks it."""
    level: int = request.param
    if level > LEVEL:
        pytest.skip("this CPU lacks " + ("AVX-512 F and BW" if level == 2 else "AVX2"))
    assert _LOADED is not None
    lib = _LOADED[0]
    monkeypatch.setattr(native, "_library", lambda: (lib, level))
    return level


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
                                            out_dtype: torch.dtype, simd: int) -> None:
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
def test_lengths_around_the_blocks(n: int, simd: int) -> None:
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


def test_non_finite_results_are_reported(simd: int) -> None:
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
def test_a_non_finite_entry_anywhere_is_reported(at: int, value: float, simd: int) -> None:
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
                                            method: str, simd: int) -> None:
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


# bfloat16 bit patterns: signed zeros, infinities, NaNs (quiet, signalling, full payloads),
# subnormals and the smallest normal, the largest finite values (whose sums overflow).
EDGE_BITS = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x7FFF, 0xFFFF,
             0x0001, 0x8001, 0x007F, 0x807F, 0x0080, 0x7F7F, 0xFF7F]
# Weights ≠ 1 for up to 16 models, bfloat16-exact (1.5 makes ties of the products) or not.
WEIGHTS = [1.5, -0.75, 0.3, 2.0, -1.3, 0.5, 0.7, 1.5] * 2


def _edge_inputs(n: int, count: int, seed: int) -> list[torch.Tensor]:
    """``count`` bfloat16 tensors (the base first) of n entries: a quarter edge values, a
    quarter differences that fall on a rounding tie (models (1 + a/128)·2^e, base 2^(e−8),
    both of random signs: a 9-bit difference ending in 1), the rest of many magnitudes."""
    g = torch.Generator().manual_seed(seed)
    kind = torch.randint(0, 4, (n,), generator=g)
    e = torch.randint(-130, 120, (n,), generator=g).double()
    out = []
    for k in range(count):
        x = (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)
             ).to(BF16)
        pick = torch.randint(0, len(EDGE_BITS), (n,), generator=g)
        edge = torch.tensor(EDGE_BITS, dtype=torch.int32)[pick].to(torch.int16).view(BF16)
        a = torch.randint(0, 128, (n,), generator=g).double()
        sign = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
        tie = (sign * (2.0 ** (e - 8) if k == 0 else (1 + a / 128) * 2.0 ** e)).to(BF16)
        out.append(torch.where(kind == 0, edge, torch.where(kind == 1, tie, x)))
    return out


def _at(xs: list[torch.Tensor], offset: int) -> list[torch.Tensor]:
    """Copies of xs starting ``offset`` entries into a fresh buffer: unaligned data."""
    out = []
    for x in xs:
        buf = torch.empty(x.numel() + offset, dtype=x.dtype)
        buf[offset:] = x
        out.append(buf[offset:])
    return out


def _kernel_at(level: int, monkeypatch: pytest.MonkeyPatch, xs: list[torch.Tensor],
               weights: list[float], params: TaskArithmeticParams, compute: torch.dtype,
               offset: int) -> tuple[torch.Tensor, bool | None]:
    """The kernel's bfloat16 result of xs at SIMD level ``level`` into an output that
    starts ``offset`` entries into its buffer."""
    assert _LOADED is not None
    lib = _LOADED[0]
    got = _at([torch.zeros(xs[0].numel(), dtype=BF16)], offset)[0]
    call = TensorCall("t", xs[0], xs[1:], [ModelParams(weight=w) for w in weights], params,
                      None, 1)
    with monkeypatch.context() as m:
        m.setattr(native, "_library", lambda: (lib, level))
        finite = get_method("task_arithmetic").merge_into(call, got, compute)
    return got, finite


def _same_as_torch_and_avx2(xs: list[torch.Tensor], weights: list[float],
                            params: TaskArithmeticParams, compute: torch.dtype, offset: int,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    method = get_method("task_arithmetic")
    mps = [ModelParams(weight=w) for w in weights]
    copies = [x.to(compute, copy=True) for x in xs]
    want = method.merge(TensorCall("t", copies[0], copies[1:], mps, params, None, 1)).to(BF16)
    avx2, finite2 = _kernel_at(1, monkeypatch, _at(xs, offset), weights, params, compute,
                               (offset * 3) % 5)
    wide, finite = _kernel_at(2, monkeypatch, _at(xs, offset), weights, params, compute,
                              (offset * 3) % 5)
    case = (compute, len(xs) - 1, xs[0].numel(), offset, params)
    # The two loops take the same steps: the same bytes, infinities and signed zeros too;
    # NaN where NaN. Not its payload: of two NaN operands x86 keeps the first, and which
    # one the compiler puts first (for add and mul) is its choice, as in torch's loops; a
    # NaN fails the merge.
    nan = torch.isnan(avx2)
    assert torch.equal(nan, torch.isnan(wide)), case
    assert torch.equal(_bits(wide)[~nan], _bits(avx2)[~nan]), case
    assert finite is not None and finite == finite2, case
    ok = torch.isfinite(want)
    assert torch.equal(ok, torch.isfinite(wide)), case
    assert torch.equal(_bits(want)[ok], _bits(wide)[ok]), case
    assert finite == bool(ok.all()), case


@pytest.mark.skipif(LEVEL < 2, reason="this CPU lacks AVX-512 F and BW")
@pytest.mark.parametrize("compute", [BF16, F32])
def test_avx512_loops_give_the_torch_steps_and_avx2_bytes(
        compute: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lengths around the 32-entry steps (the masked tail), unaligned inputs and output,
    edge values and ties, 1-5 and 16 models, weights ≠ 1, normalize and λ on and off."""
    cases = itertools.product([0, 1, 15, 16, 17, 31, 33], [1, 2, 3, 4, 5, 16],
                              [False, True], [1.0, -1.3])
    for i, (n, models, normalize, lam) in enumerate(cases):
        params = TaskArithmeticParams(normalize=normalize, **{"lambda": lam})
        xs = _edge_inputs(n, models + 1, seed=i)
        _same_as_torch_and_avx2(xs, WEIGHTS[:models], params, compute, i % 4, monkeypatch)


@pytest.mark.skipif(LEVEL < 2, reason="this CPU lacks AVX-512 F and BW")
@pytest.mark.parametrize("compute", [BF16, F32])
@pytest.mark.parametrize("models", [1, 2, 3, 4, 5, 16])
def test_avx512_loops_on_a_long_run(compute: torch.dtype, models: int,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    params = TaskArithmeticParams(normalize=models % 2 == 1, **{"lambda": 0.9})
    weights = [1.0] * models if models == 4 else WEIGHTS[:models]
    xs = _edge_inputs(1000003, models + 1, seed=models)
    _same_as_torch_and_avx2(xs, weights, params, compute, models % 3, monkeypatch)


def test_the_switch_keeps_task_arithmetic_on_avx2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAEC_NATIVE_AVX512", "0")
    native._library.cache_clear()
    try:
        loaded = native._library()
        assert loaded is not None and loaded[1] == min(LEVEL, 1)
    finally:
        monkeypatch.undo()
        native._library.cache_clear()
    again = native._library()
    assert again is not None and again[1] == LEVEL


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
