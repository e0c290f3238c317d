"""An MoE job's attempt (``method: moe``, a mergekit-moe config): fetch the checkpoints,
build the mixture of experts with ``maec_core.moe``, publish it as a merge is published
(shards uploaded as they finish, quota reserved, manifest last)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.disk_cache import Hold
from app.jobs.record import JobRecord
from maec_core.context import RunContext
from maec_core.moe.build import build_moe
from maec_core.moe.config import parse_moe_config
from maec_core.runtime import EngineOptions
from worker.publish import ShardUploads

if TYPE_CHECKING:
    from worker.runner import Attempt, JobRunner

# The build is the job's "combine" stage, as the contract names its stages.
SPANS = {"fetch": (0.0, 0.05), "combine": (0.05, 0.95), "publish": (0.95, 1.0)}


def execute_moe(runner: JobRunner, rec: JobRecord, att: Attempt, prefix: str,
                workdir: Path, hold: Hold) -> dict[str, Any]:
    """Build and publish the job's MoE; the record fields a succeeded job gains."""
    # Parsed once from the record, checked again (the record is the truth, not the API).
    config = parse_moe_config(rec.recipe)
    att.spans = SPANS
    local = runner._fetch(rec, None, att, workdir, hold)
    config = config.with_sources(local)
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "out"
    uploads = ShardUploads(runner.storage, prefix)
    try:
        ctx = RunContext(progress=lambda _s, d, t: att.progress("combine", d, t),
                         cancel=att.cancel_requested,
                         hash_cache=runner.settings.work_dir / "checksums",
                         options=EngineOptions(on_shard=uploads.on_shard,
                                               on_shard_open=uploads.on_shard_open))
        made = build_moe(config, out, ctx)
        runner._reserve(rec, att, made.manifest, out)
        files = runner._publish(rec, att, out, made.manifest, uploads)
    except BaseException:
        uploads.stop()
        raise
    uploads.close()
    for f in files:
        f["url"] = f"/v1/jobs/{rec.id}/files/{f['path']}"
    report = {**(made.report or {}),
              "stage_seconds": {k: round(v, 4) for k, v in made.stage_seconds.items()}}
    return {
        "result": {"manifest": made.manifest, "report": report, "files": files,
                   "core_seconds": round(made.seconds, 4)},
        "result_prefix": prefix,
        "progress": {"fraction": 1.0, "done": len(files), "total": len(files)},
        "_bytes": sum(int(f["size"]) for f in files),
    }
