"""What the /ui templates show, computed from job records (no HTTP here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import yaml

from app.jobs.record import TERMINAL, JobRecord
from app.kinds import record_kind


@dataclass
class Row:
    """One line of the job list."""

    id: str
    name: str | None
    status: str
    method: str
    bases: list[str]
    donors: list[str]
    created: str
    duration: str


@dataclass
class FileRow:
    path: str
    size: str
    sha256: str
    href: str


@dataclass
class Detail:
    """The job page: the record plus everything derived for display."""

    job: dict[str, Any]
    row: Row
    terminal: bool
    recipe_yaml: str
    files: list[FileRow] = field(default_factory=list)
    plots: list[FileRow] = field(default_factory=list)
    evaluation: dict[str, Any] | None = None
    sweep: dict[str, Any] | None = None
    # The leaderboard's score columns: every eval set any candidate was scored on.
    sweep_scores: list[str] = field(default_factory=list)


def _when(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def duration(rec: JobRecord, now: datetime | None = None) -> str:
    """Run time so far (running) or in all (ended); blank before it started."""
    start = _when(rec.started_at)
    if start is None:
        return ""
    end = _when(rec.finished_at) or (now or datetime.now(UTC))
    seconds = max(0.0, (end - start).total_seconds())
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s"


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"  # pragma: no cover - the loop returns at GiB


def row(rec: JobRecord) -> Row:
    bases, donors = record_kind(rec).inputs(rec.recipe)
    return Row(id=rec.id, name=rec.name, status=rec.status, method=rec.method,
               bases=bases, donors=donors, created=rec.created_at.replace("T", " "),
               duration=duration(rec))


def file_href(job_id: str, path: str, *, download: bool) -> str:
    href = f"/ui/jobs/{quote(job_id)}/files/{quote(path)}"
    return href + "?download=1" if download else href


def detail(rec: JobRecord) -> Detail:
    result = rec.result or {}
    files = [
        FileRow(path=str(f["path"]), size=human_size(int(f["size"])),
                sha256=str(f["sha256"]), href=file_href(rec.id, str(f["path"]), download=True))
        for f in result.get("files", [])
    ] if rec.status == "succeeded" else []
    plots = [FileRow(f.path, f.size, f.sha256, file_href(rec.id, f.path, download=False))
             for f in files if f.path.lower().endswith(".png")]
    evaluation = result.get("evaluation")
    sweep = result.get("sweep") if isinstance(result.get("sweep"), dict) else None
    scores = [k for r in (sweep or {}).get("rows", []) if isinstance(r, dict)
              for k in (r.get("scores") or {})]
    return Detail(
        job=rec.public(), row=row(rec), terminal=rec.status in TERMINAL,
        recipe_yaml=yaml.safe_dump(rec.recipe, sort_keys=False, default_flow_style=False),
        files=files, plots=plots,
        evaluation=evaluation if isinstance(evaluation, dict) else None,
        sweep=sweep, sweep_scores=list(dict.fromkeys(scores)),
    )


def state(rec: JobRecord) -> dict[str, Any]:
    """What the page's script polls: enough to move the progress bar."""
    return {"id": rec.id, "status": rec.status, "stage": rec.stage,
            "progress": rec.progress.model_dump(mode="json"),
            "duration": duration(rec), "terminal": rec.status in TERMINAL,
            "error": rec.error}
