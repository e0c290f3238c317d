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
from maec_core.context import RunContext
from maec_core.moe.build import build_moe
from maec_core.moe.config import parse_moe_config
from maec_core.runtime import EngineOptions
from worker.publish import ShardUploads


class Attempt(Protocol):
    """What the build uses of ``worker.runner.Attempt`` (typed here, not imported: the
    runner imports this module)."""

    spans: dict[str, tuple[float, float]] | None

    def progress(self, stage: str, done: int, total: int) -> None: ...

    def cancel_requested(self) -> bool: ...


class Runner(Protocol):
    """What the build uses of ``worker.runner.JobRunner``: its fetch, quota and publish
    steps, shared with merges."""

    settings: Settings
    storage: Storage

    def _fetch(self, rec: JobRecord, recipe: None, att: Any, workdir: Path,
               hold: Hold) -> dict[str, str]: ...

    def _reserve(self, rec: JobRecord, att: Any, manifest: dict[str, Any],
                 out: Path) -> None: ...

    def _publish(self, rec: JobRecord, att: Any, out: Path, manifest: dict[str, Any],
                 uploads: ShardUploads) -> list[dict[str, Any]]: ...

# The build is the job's "combine" stage, as the contract names its stages.
SPANS = {"fetch": (0.0, 0.05), "combine": (0.05, 0.95), "publish": (0.95, 1.0)}


def execute_moe(runner: Runner, rec: JobRecord, att: Attempt, prefix: str,
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
