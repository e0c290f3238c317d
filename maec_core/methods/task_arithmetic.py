"""Task arithmetic (Ilharco et al. 2023, arXiv:2212.04089): ``θ0 + λ Σ w_i (θ_i − θ0)``.

Its global parameters are shared by the task-vector family (TIES, DARE, Breadcrumbs).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import Field

from maec_core.methods._common import WeightParams
from maec_core.methods.base import Kernel, Params, TensorCall, TensorMethod
from maec_core.methods.scalars import held

if TYPE_CHECKING:
    import torch

    from maec_core.native import TaskArithmeticSteps


class TaskArithmeticParams(Params):
    normalize: bool = False
    lambda_: float = Field(1.0, alias="lambda")
    # Accepted so mergekit recipes run unchanged; masks are a GPU-memory trick there and
    # have no effect on results here.
    int8_mask: bool = False
    # True: a sparsified task vector is scaled back to the L1 norm it had before (for the
    # methods that sparsify; task arithmetic itself keeps every entry, so it is a no-op).
    rescale: bool = False


class TaskArithmeticModelParams(WeightParams):
    # Accepted, with mergekit's default, and ignored as there: task arithmetic keeps
    # every entry, so a recipe written for the sparsifying methods runs unchanged.
    density: float = 1.0


class TaskArithmetic(TensorMethod):
    name = "task_arithmetic"
    paper = "Ilharco et al. 2023, Editing models with task arithmetic (arXiv:2212.04089)"
    params = TaskArithmeticParams
    model_params = TaskArithmeticModelParams
    elementwise = True

    def merge(self, call: TensorCall) -> torch.Tensor:
        """``θ0 + λ Σ w_i (θ_i − θ0)``; normalize divides by ``Σ w_i``.

        Op for op as mergekit 0.1.5, in the compute dtype: each delta times its weight,
        the weighted deltas summed, divided by the summed weights when normalising,
        times λ, added to the base. A recipe written for mergekit gives its bytes, in
        every compute dtype, on whole tensors or on the engine's flat slices.
        """
        base = call.base
        assert base is not None
        if not call.models:
            return base
        return _in_place(call, [p.weight for p in call.model_params])

    def kernel(self, call: TensorCall, compute: str) -> Kernel | None:
        """:meth:`merge` of flat runs of the stored base and models, in one compiled
        pass with its roundings (``maec_core.native``); see the base class. Its scalars
        are held as torch holds them (``maec_core.methods.scalars``); normalising takes
        their sum in the compute dtype, which only torch gives here: no kernel then."""
        from maec_core.native import task_arithmetic_flat

        steps = _steps(call, compute)
        if steps is None:
            return None
        return lambda inputs, out: task_arithmetic_flat(inputs[0], inputs[1:], steps, out)

    def merge_into(self, call: TensorCall, out: torch.Tensor, compute: torch.dtype
                   ) -> bool | None:
        """:meth:`merge` of flat slices in their stored dtype, straight into ``out``, in
        one compiled pass with the same roundings (``maec_core.native``); see the base
        class."""
        import torch

        from maec_core.native import TaskArithmeticSteps, task_arithmetic

        base = call.base
        if base is None or not call.models:
            return None
        name = str(compute).removeprefix("torch.")
        steps = _steps(call, name)
        if steps is None and call.params.normalize:
            # The scalars exactly as _in_place holds them.
            weights = torch.tensor([p.weight for p in call.model_params], dtype=compute)
            total = weights.sum()
            divisor = 1.0 if bool(total.abs() < 1e-8) else float(total)
            lam = None if call.params.lambda_ == 1 else float(call.params.lambda_)
            if lam is not None and not torch.tensor(lam, dtype=compute).isfinite():
                return None  # torch's path refuses it (a parameter beyond the dtype's range)
            steps = TaskArithmeticSteps(name, weights.tolist(), divisor, lam)
        return None if steps is None else task_arithmetic(base, call.models, steps, out)


def _steps(call: TensorCall, compute: str) -> TaskArithmeticSteps | None:
    """The kernel's scalars for ``call`` in ``compute`` (its name) as :func:`_in_place`
    holds them, without torch; None when they need torch (normalising) or when torch's
    path refuses them (a λ beyond the dtype's range) or there is nothing to merge."""
    from maec_core.native import TaskArithmeticSteps

    if call.params.normalize or not call.model_params:
        return None
    lam = None if call.params.lambda_ == 1 else float(call.params.lambda_)
    if lam is not None and not math.isfinite(held([lam], compute)[0]):
        return None
    return TaskArithmeticSteps(compute, held([p.weight for p in call.model_params], compute),
                               None, lam)


def _in_place(call: TensorCall, weights: list[float]) -> torch.Tensor:
    """The merge in the inputs' own buffers, the engine's streaming path: no stacked
    copy of the deltas, and every step element-wise, so a flat slice of the inputs gives
    that slice of the whole tensor's result.

    Each step is the torch op mergekit runs, on the same dtype: in 16 bits torch's CPU
    ops compute each entry in float32 and round once to the 16-bit type, which is the
    correctly rounded 16-bit result whatever the slice. Only mergekit's sum over the
    stacked deltas is not one such op; :func:`_sum_stacked` reproduces it."""
    import torch

    base = call.base
    assert base is not None
    # The weights as mergekit holds them: in the compute dtype.
    held = torch.tensor(weights, dtype=base.dtype)
    deltas = []
    for m, w in zip(call.models, held.tolist(), strict=True):
        delta = m.sub_(base)
        if w != 1.0:  # times 1 is exact: a pass saved
            delta.mul_(w)
        deltas.append(delta)
    mixed = _sum_stacked(deltas)
    if call.params.normalize:
        divisor = held.sum()
        # Compared in the compute dtype, as mergekit does: 1e-8 is 0 in float16, so
        # weights summing to 0 there divide by 0 (and the merge fails as non-finite).
        if bool(divisor.abs() < 1e-8):
            divisor.fill_(1.0)
        mixed.div_(divisor)
    if call.params.lambda_ != 1:
        mixed.mul_(call.params.lambda_)
    return mixed.add_(base)


def _sum_stacked(deltas: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(deltas).sum(dim=0)``, in ``deltas[0]`` (no stacked copy).

    16-bit rows: mergekit's bytes. torch's CPU sum over the first axis accumulates
    16-bit rows in float32 and rounds once; up to 16 rows it adds them in order from
    +0.0 (more rows: :func:`_float32_row_sum`). Two rows are then one 16-bit add (a
    float32 sum of two 16-bit values, rounded to 16 bits, is their correctly rounded
    sum, which torch's add computes) and ``+ 0.0`` for the start, which turns a sum of
    negative zeros into +0.0 and changes nothing else.

    float32 rows are summed in place in order, the streaming hot path's choice: torch
    sums up to four float32 rows so, bit for bit, except that its +0.0 start makes a sum
    of negative zeros +0.0 (reaching the output only where the base is -0.0 and every
    weighted delta is -0.0); from five rows it associates some entries differently,
    within float32's last bit. Matching either would cost passes over every slice.
    """
    first = deltas[0]
    if first.dtype.itemsize >= 4:
        for d in deltas[1:]:
            first.add_(d)
        return first
    if len(deltas) <= 2:
        for d in deltas[1:]:
            first.add_(d)
        return first.add_(0.0)
    return first.copy_(_float32_row_sum(deltas))


# torch's CPU sum over the first axis of a stacked 16-bit tensor adds rows in groups of
# ROW_GROUP, each from +0.0, into LEVELS cascaded partial sums (its multi-row sum; so in
# the pinned torch, which tests/core/test_methods.py checks against).
ROW_BITS = 4
ROW_GROUP = 1 << ROW_BITS
LEVELS = 4


def _float32_row_sum(rows: list[torch.Tensor]) -> torch.Tensor:
    """The float32 sum of 16-bit ``rows`` with torch's CPU association: up to
    ``ROW_GROUP`` rows in order from +0.0; more rows as groups of ``ROW_GROUP``, each
    summed from +0.0 and carried into the next level's partial sum (a level passes its
    total on once every ``ROW_GROUP`` of its own), the last rows from +0.0 in the first
    level, and the levels added last, lowest first."""
    import torch

    def zeros() -> torch.Tensor:
        return torch.zeros(rows[0].shape, dtype=torch.float32, device=rows[0].device)

    if len(rows) <= ROW_GROUP:
        total = zeros()
        for r in rows:
            total.add_(r)
        return total
    acc = [zeros() for _ in range(LEVELS)]
    i = 0
    while i + ROW_GROUP <= len(rows):
        for r in rows[i:i + ROW_GROUP]:
            acc[0].add_(r)
        i += ROW_GROUP
        for j in range(1, LEVELS):
            acc[j].add_(acc[j - 1])
            acc[j - 1].zero_()
            # The next level takes this one's total only every ROW_GROUP of them.
            if i & ((ROW_GROUP - 1) << (j * ROW_BITS)):
                break
    for r in rows[i:]:
        acc[0].add_(r)
    for j in range(1, LEVELS):
        acc[0].add_(acc[j])
    return acc[0]
