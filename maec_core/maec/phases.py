"""MAEC split across a pool's workers: a :class:`~maec_core.methods.base.PhasedMerge`.

MAEC decides one thing over the whole model, which no part sees alone: with
``selection: ratio`` the tensors kept are the ``ceil(ratio * T)`` lowest |c_t| among all
T tensors carrying ability weights (and ``rank_scope: global`` ranks key rows over all
tensors, in extraction). A merge split into parts (contiguous groups of its output
shards) therefore runs:

1. before the parts, once: every ability vector reused from the artifact store or, when
   missing, extracted whole and put there (extraction is not split); the record: the
   artifact keys and which were reused;
2. phase ``score``, in parts: each part measures c_t of the carrying tensors among its
   shards' (the key rows of θL and θ0, and the stored R(A)); its result: those c_t;
3. once, when every part has scored: the selection rule over all the c_t
   (:func:`maec_core.maec.combine.decide`, the unsplit merge's code); the record: every
   c_t and the tensors kept;
4. the merge, in parts, then the final step (index, card, report): ``run_maec`` given
   both records (``EngineOptions.phase_records``) combines with that selection, measuring
   nothing again, so shards, report and card are the unsplit merge's byte for byte.

The texts are :mod:`maec_core.maec.records`'.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from maec_core.context import RunContext
from maec_core.io.reader import SAFETENSORS_NAMES
from maec_core.io.writer import OutputTensor, shard_layout
from maec_core.maec.artifact import load_artifact
from maec_core.maec.combine import decide as apply_selection
from maec_core.maec.combine import measure
from maec_core.maec.pipeline import (
    BASE,
    LANG,
    _Found,
    _inputs,
    _output_plan,
    _params,
    find_or_extract,
    stored_artifacts,
)
from maec_core.maec.records import Found, dump_cosines, dump_selection, load_cosines
from maec_core.plan import MergePlan
from maec_core.recipe import Recipe
from maec_core.runtime import torch_dtype

SCORE = "score"


def shard_tensors(recipe: Recipe, plan: MergePlan) -> list[list[str]]:
    """The names of the tensors of each output shard, in shard order: the combination's
    output (θL's tensors in the recipe's dtype, cut at its shard size)."""
    target = torch_dtype(recipe.dtype or plan.input_dtype)
    outputs = [OutputTensor(t.name, t.shape, SAFETENSORS_NAMES[target]) for t in plan.tensors]
    return [[t.name for t in shard] for shard in shard_layout(outputs,
                                                              recipe.shard_size_bytes())]


class MaecPhases:
    """A split MAEC merge of ``recipe`` (its inputs local)."""

    phases: tuple[str, ...] = (SCORE,)

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.params = _params(recipe)

    def shard_count(self) -> int:
        return len(shard_tensors(self.recipe, _output_plan(self.recipe)))

    def before(self, workdir: Path, ctx: RunContext) -> str:
        """The ability vectors found in ``ctx.artifact_store``, or extracted into it."""
        return find_or_extract(self.recipe, workdir, ctx).dump()

    def run_part(self, phase: int, part: tuple[int, int], records: Sequence[str],
                 ctx: RunContext) -> str:
        """c_t of the carrying tensors of shards ``part[0]`` to ``part[1] - 1``."""
        self._check_phase(phase)
        found = Found.load(records[0])
        inputs = _inputs(self.recipe, self.params,
                         _Found(stored_artifacts(found.keys, ctx), found.reused),
                         ctx.hash_cache)
        groups = shard_tensors(self.recipe, inputs.plan)
        names = {n for shard in groups[part[0]:part[1]] for n in shard}

        def step(done: int, total: int) -> None:
            ctx.report("combine", done, total)

        return dump_cosines(measure(inputs.plan, inputs.artifacts, ctx, keys=(BASE, LANG),
                                    step=step, remap=inputs.remap, only=names))

    def decide(self, phase: int, results: Sequence[str], records: Sequence[str],
               ctx: RunContext) -> str:
        """Every part's c_t joined (per ability in the artifact's tensor order, as the
        unsplit merge measures them), then the selection rule, once."""
        self._check_phase(phase)
        found = Found.load(records[0])
        parts = [load_cosines(r) for r in results]
        cosines: list[dict[str, float]] = []
        for k, path in enumerate(stored_artifacts(found.keys, ctx)):
            joined = {n: c for part in parts for n, c in part[k].items()}
            order = load_artifact(path, verify=False).tensors
            cosines.append({n: joined[n] for n in order if n in joined})
        return dump_selection(apply_selection(self.params, cosines))

    def _check_phase(self, phase: int) -> None:
        if not 0 <= phase < len(self.phases):
            raise ValueError(f"a split MAEC merge has {len(self.phases)} phase(s) before "
                             f"it combines; asked for phase {phase}")


__all__ = ["SCORE", "MaecPhases", "shard_tensors"]
