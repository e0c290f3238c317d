"""The MoE job kind (``method: moe``, a mergekit-moe config): build the mixture of experts
from the fetched checkpoints with ``maec_core.moe``; the runner publishes it as a merge
is published (shards uploaded as they finish, quota reserved, manifest last)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from app.jobs.record import JobRecord
from maec_core.service import (
    Manifest,
    MoeConfig,
    StageSpans,
    job_spans,
    parse_moe_config,
    published_manifest,
)
from maec_core.service.running import build_moe
from worker.job_kind import Made, Run

# The build is the job's "combine" stage, as the contract names its stages: a merge's
# spans without an extract stage.
SPANS = job_spans(extracts=False, evaluates=False)


@dataclass(frozen=True)
class MoeJob:
    """One MoE build: every input is a checkpoint folder."""

    config: MoeConfig

    @property
    def spans(self) -> StageSpans:
        return SPANS

    @property
    def resumable(self) -> bool:
        return False  # an MoE build restarts whole (its output is not planned shard by shard)

    def one_file(self, ref: str) -> bool:
        return False

    def check(self, local: Mapping[str, str]) -> None:
        """Nothing beyond the config's own checks (run again when it was parsed)."""

    def produce(self, run: Run) -> Made:
        progress = run.ctx.progress
        # The published config, card, manifest and report name each source by its
        # reference, as a merge's do, never by the worker's copy: given to the run once.
        ctx = run.ctx.but(progress=None if progress is None else (
            lambda _stage, done, total: progress("combine", done, total)),
            names={path: ref for ref, path in run.local.items()})
        made = build_moe(self.config.with_sources(run.local), run.out, ctx)
        # Every source of an MoE build is a checkpoint the manifest names.
        manifest = published_manifest(made.manifest, run.local, run.local,
                                      run.ctx.hash_cache)
        report = {**(made.report or {}),
                  "stage_seconds": {k: round(v, 4) for k, v in made.stage_seconds.items()}}
        return Made(Manifest.of(manifest), report, made.seconds)


class MoeKind:
    """Records of the ``moe`` kind (method ``moe``, ``app.kinds.moe``)."""

    def plan(self, rec: JobRecord) -> MoeJob:
        # Parsed once from the record, checked again (the record is the truth, not the API).
        return MoeJob(parse_moe_config(rec.recipe))


MOE = MoeKind()
