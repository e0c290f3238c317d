"""What a merge method implementation receives for one tensor."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel


@dataclass(frozen=True)
class TensorCall:
    """One tensor's merge inputs, all float32 on the compute device.

    ``models`` are the recipe's models besides ``base`` (in recipe order), with
    ``model_params`` resolved for this tensor; ``params`` are the method's global
    parameters resolved for this tensor.

    The input tensors belong to the call: the engine hands out private float32 copies,
    so a method may overwrite them and return one of them (the cheapest way to produce
    its result). For element-wise methods they may be flat slices of the real tensors.
    """

    name: str
    base: torch.Tensor | None
    models: Sequence[torch.Tensor]
    model_params: Sequence[Any]
    params: Any
    layer: int | None
    num_layers: int


MergeFn = Callable[[TensorCall], torch.Tensor]
ParamsT = BaseModel
