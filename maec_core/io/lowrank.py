"""Form a tensor that is a stored tensor plus a low-rank delta, while reading it.

A LoRA adapter on a base reads like a full checkpoint: its targeted tensors are
``base + scale * B @ A``. Readers call :func:`with_delta` on what they read of the base
(the whole tensor or some rows of it), so the sum exists for one tensor at a time and
never as a checkpoint. The arithmetic is float32 and the sum is cast back to the base's
dtype, as peft's ``merge_and_unload`` leaves it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from maec_core.io.headers import LowRankDelta, TensorInfo

ReadFn = Callable[[TensorInfo], torch.Tensor]


def delta_rows(delta: LowRankDelta, read: ReadFn, rows: torch.Tensor | slice | None = None
               ) -> torch.Tensor:
    """``scale * B @ A`` in float32 (transposed when the base stores ``(in, out)``),
    restricted to ``rows`` of the result when given: only those rows are computed."""
    a = read(delta.a).to(torch.float32)
    b = read(delta.b).to(torch.float32)
    if rows is None:
        rows = slice(None)
    elif isinstance(rows, torch.Tensor):
        rows = rows.cpu()
    if delta.transpose:
        # Rows of (B @ A).T are columns of B @ A: B @ A[:, rows], transposed.
        return (b @ a[:, rows]).T.mul_(delta.scale)
    return (b[rows] @ a).mul_(delta.scale)


def with_delta(info: TensorInfo, base: torch.Tensor, read: ReadFn,
               rows: torch.Tensor | slice | None = None) -> torch.Tensor:
    """``base`` (the stored tensor, or ``rows`` of it viewed as ``(rows, -1)``) plus
    ``info``'s low-rank delta on the same rows, in ``base``'s dtype and shape."""
    if info.delta is None:
        return base
    d = delta_rows(info.delta, read, rows)
    return (base.to(torch.float32) + d.reshape(base.shape)).to(base.dtype)
