"""An MoE job's attempt (``method: moe``, a mergekit-moe config): fetch the checkpoints,
build the mixture of experts with ``maec_core.moe``, publish it as a merge is published
(shards uploaded as they finish, quota reserved, manifest last)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from app.disk_cache import Hold
from app.jobs.record import JobRecord
from app.settings import Settings
from app.storage.base import Storage
from maec_contract import FileInfo, JobResult
from maec_core.service import (
    JobPlan,
    StageSpans,
    job_spans,
    parse_moe_config,
    published_manifest,
    write_manifest,
)
from maec_core.service.running import EngineOptions, RunContext, build_moe
from worker.publish import ShardUploads
from worker.result import Finished


class Attempt(Protocol):
    """What the build uses of ``worker.runner.Attempt`` (typed here, not imported: the
    runner imports this module)."""

    spans: StageSpans

    def progress(self, stage: str, done: int, total: int) -> None: ...

    def cancel_requested(self) -> bool: ...


class Runner(Protocol):
    """What the build uses of ``worker.runner.JobRunner``: its fetch, quota and publish
    steps, shared with merges."""

    settings: Settings
    storage: Storage

    def _fetch(self, rec: JobRecord, plan: None, att: Any, workdir: Path,
               hold: Hold) -> dict[str, str]: ...

    def _reserve(self, rec: JobRecord, att: Any, manifest: dict[str, Any],
                 entry: dict[str, Any], already: int = 0) -> None: ...

    def _publish(self, rec: JobRecord, att: Any, out: Path, manifest: dict[str, Any],
                 entry: dict[str, Any], uploads: ShardUploads) -> list[dict[str, Any]]: ...

# The build is the job's "combine" stage, as the contract names its stages: a merge's
# spans without an extract stage.
SPANS = job_spans(extracts=False, evaluates=False)


def execute_moe(runner: Runner, rec: JobRecord, att: Attempt, prefix: str,
                workdir: Path, hold: Hold) -> Finished:
    """Build and publish the job's MoE; what the succeeded job keeps."""
    # Parsed once from the record, checked again (the record is the truth, not the API).
    config = parse_moe_config(rec.recipe)
    att.spans = SPANS
    local = runner._fetch(rec, None, att, workdir, hold)
    config = config.with_sources(local)
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "out"
    uploads = ShardUploads(runner.storage, prefix)
    hash_cache = runner.settings.work_dir / "checksums"
    try:
        ctx = RunContext(progress=lambda _s, d, t: att.progress("combine", d, t),
                         cancel=att.cancel_requested, hash_cache=hash_cache,
                         options=EngineOptions(on_shard=uploads.on_shard,
                                               on_shard_open=uploads.on_shard_open))
        made = build_moe(config, out, ctx)
        # Every source of an MoE build is a checkpoint the manifest names.
        manifest = published_manifest(made.manifest, local, local, hash_cache)
        entry = write_manifest(out, manifest)
        runner._reserve(rec, att, manifest, entry)
        files = runner._publish(rec, att, out, manifest, entry, uploads)
    except BaseException:
        uploads.stop()
        raise
    uploads.close()
    report = {**(made.report or {}),
              "stage_seconds": {k: round(v, 4) for k, v in made.stage_seconds.items()}}
    result = JobResult(
        manifest=manifest, report=JobPlan.named(report, local),
        files=[FileInfo(**f, url=f"/v1/jobs/{rec.id}/files/{f['path']}") for f in files],
        core_seconds=round(made.seconds, 4))
    return Finished(result, prefix, None)

