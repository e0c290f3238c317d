"""Which stored input tensors a group of output shards reads: what a part of a split
merge, or a resumed attempt, must fetch of its inputs (their headers and these byte
ranges), taken from the engine's own shard plan (:func:`maec_core.engine.plain_shard_plan`).

A plain tensor method's output tensor is made of the tensor of the same name in each
input, so the reads of a shard are its tensors' names looked up in every input's
headers. Anything else (slices, MAEC, MoE, LoRA output, a vocabulary merge, an adapter
applied to a base) is refused with ``NotSplittable``: its reads are not named that way.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from maec_core.engine import plain_shard_plan
from maec_core.errors import NotSplittable
from maec_core.recipe import Recipe


@dataclass(frozen=True, order=True)
class InputSpan:
    """One stored input tensor a merge reads: bytes ``[start, end)`` of ``file``."""

    file: Path
    start: int
    end: int
    name: str


def shard_reads(recipe: Recipe, shards: Collection[int]) -> dict[str, list[InputSpan]]:
    """The stored tensors a merge of ``recipe`` (its inputs local) reads to make the
    output shards ``shards`` (0-based indices of its fixed shard plan), per input (the
    recipe's reference of the model), in file order. Headers only; nothing is read.

    ``NotSplittable`` where the plan is not one whose reads are the same names in each
    input (see the module docstring); a shard index outside the plan is refused too.
    """
    planned = plain_shard_plan(recipe)
    if planned is None:
        raise NotSplittable(f"a {recipe.merge_method} merge of this recipe is not a plain "
                            "tensor method's: its reads are not named by shard",
                            method=recipe.merge_method)
    if planned.vocab:
        raise NotSplittable("a merge that builds a vocabulary reads rows, not named tensors")
    bad = sorted(i for i in shards if not 0 <= i < len(planned.shards))
    if bad:
        raise NotSplittable(f"shard {bad[0]} is not one of the {len(planned.shards)} "
                            "planned shards", shards=len(planned.shards))
    wanted = {t.name for i in shards for t in planned.shards[i]}
    reads: dict[str, set[InputSpan]] = {}
    for t in planned.plan.tensors:
        if t.name not in wanted:
            continue
        for key, info in t.sources.items():
            if info.delta is not None:
                raise NotSplittable(f"{t.name} of {planned.refs[key]} is formed from an "
                                    "adapter, not read by name", tensor=t.name)
            reads.setdefault(planned.refs[key], set()).add(
                InputSpan(Path(info.file), info.start, info.end, info.name))
    return {ref: sorted(spans) for ref, spans in reads.items()}
