"""A method's scalar parameters as torch holds them in a tensor of the compute dtype,
without torch: what a kernel is given when the merge runs without it
(``maec_core.kernel_merge``).

``torch.tensor(values, dtype=d)`` stores each Python float rounded to float32 first,
then to ``d`` (c10's 16-bit types are built from a float32), both to nearest even; the
values read back (``tolist``) are those roundings, exactly.
"""

from __future__ import annotations

from collections.abc import Sequence


def held(values: Sequence[float], dtype: str) -> list[float]:
    """``torch.tensor(values, dtype=<dtype>).tolist()`` for ``dtype`` float32, bfloat16
    or float16."""
    import numpy as np  # here: loading the method registry imports neither numpy nor torch

    with np.errstate(over="ignore"):  # beyond the range: inf, as torch stores it
        f32 = np.asarray(values, dtype=np.float64).astype(np.float32)
        if dtype == "float32":
            return [float(v) for v in f32]
        if dtype == "float16":
            return [float(v) for v in f32.astype(np.float16)]
    if dtype != "bfloat16":
        raise ValueError(f"no {dtype} scalars")
    bits = f32.view(np.uint32).astype(np.uint64)
    # Round to nearest even on the upper 16 bits (c10's round_to_nearest_even); a NaN
    # becomes the canonical quiet NaN.
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint32)
    rounded[np.isnan(f32)] = 0x7FC0
    return [float(v) for v in (rounded << 16).view(np.float32)]
