"""What ``GET /v1/jobs/{id}`` and ``GET /v1/jobs`` answer, and the error body.

Field order is the order the service serialises (the job store assembles the body from
the stored fields in this order), so a parsed job dumps back to the same JSON.

Parsing is lenient where a newer service may differ from an older client: unknown fields
are kept (``extra="allow"``), ``status`` accepts any string, and every field but a job's
``id`` and ``status`` (a file's ``path``, ``size``, ``sha256``) may be missing and takes a
default. The published schema still lists every field as required, with its exact type,
because the service always sends them all.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

JobStatus = Literal["queued", "running", "publishing", "succeeded", "failed", "cancelled"]
STATUSES: tuple[JobStatus, ...] = (
    "queued", "running", "publishing", "succeeded", "failed", "cancelled",
)
TERMINAL: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})

# A str when parsing, so a status added later does not make every read of that job fail;
# the schema still names the statuses the service sends today.
StatusText = Annotated[str, WithJsonSchema({"type": "string", "enum": list(STATUSES)})]


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_serialization_defaults_required=True)


class Progress(_Answer):
    fraction: float = 0.0
    done: int = 0
    total: int = 0


class ErrorBody(_Answer):
    """Every error answer, and a failed job's ``error``: a stable ``code`` to branch on."""

    code: str
    message: str = ""
    details: dict[str, Any] = Field(default_factory=dict)


def file_url(job_id: str, path: str) -> str:
    """Where the service serves a job's published file, relative to the service."""
    return f"/v1/jobs/{job_id}/files/{path}"


class FileInfo(_Answer):
    path: str
    size: int
    sha256: str
    # Relative to the service (:func:`file_url`) or absolute. The service adds it when it
    # answers (the stored record keeps files without it), so it always sends one.
    url: str = ""


def with_file_urls(result: dict[str, Any], job_id: str) -> dict[str, Any]:
    """A stored result as it is served: each of its ``files`` given its URL
    (:func:`file_url`), after the entry's other fields. A URL already stored (a record
    written before the service added them) is kept."""
    files = result.get("files")
    if not isinstance(files, list) or not any(
            isinstance(f, dict) and not f.get("url") for f in files):
        return result
    served = [{**f, "url": file_url(job_id, str(f.get("path", "")))}
              if isinstance(f, dict) and not f.get("url") else f for f in files]
    return {**result, "files": served}


class EvalTable(_Answer):
    """Rows models, columns eval sets; each cell the set's value (null: not scored)."""

    columns: list[dict[str, Any]] = Field(default_factory=list)
    rows: list[dict[str, Any]] = Field(default_factory=list)


class Evaluation(_Answer):
    """A job's evaluation (``evaluate``): the table; every item is in ``report``."""

    label: str = ""
    report: str = "eval_report.json"
    table: EvalTable = Field(default_factory=EvalTable)


class LeaderboardRow(_Answer):
    id: str
    values: dict[str, float] = Field(default_factory=dict)
    scores: dict[str, float] = Field(default_factory=dict)
    objective: float = 0.0
    feasible: bool = True
    # 1 = the winner; null for candidates that broke the constraint.
    rank: int | None = None
    extracted: bool = False
    seconds: float = 0.0


class SweepSummary(_Answer):
    """A sweep job's leaderboard: every candidate, the winner and why."""

    winner: str | None = None
    why: str = ""
    knobs: list[str] = Field(default_factory=list)
    objective: dict[str, Any] = Field(default_factory=dict)
    constraint: dict[str, Any] | None = None
    # Decides between candidates with equal objective values (then grid order).
    tie_break: dict[str, Any] | None = None
    reference: dict[str, float] = Field(default_factory=dict)
    rows: list[LeaderboardRow] = Field(default_factory=list)
    extractions: int = 0
    publish: str = "best"
    # MAEC: whether the language base was held in memory for all candidates (read from
    # disk once) and within what budget: language_base, language_base_bytes,
    # ability_vector_groups, budget_bytes. Null for other methods.
    resident: dict[str, Any] | None = None
    # publish: all: each candidate's folder under the job's files ("candidates/c01/").
    candidates: dict[str, str] = Field(default_factory=dict)


class JobResult(_Answer):
    """A succeeded job's ``result``: the worker builds this model and the service serves
    it as stored. Bookkeeping (where the files are stored, the bytes counted against the
    owner's quota) is kept beside it in the job record, never in it."""

    manifest: dict[str, Any] = Field(default_factory=dict)
    report: dict[str, Any] = Field(default_factory=dict)
    files: list[FileInfo] = Field(default_factory=list)
    core_seconds: float = 0.0

    # ``evaluation`` and ``sweep`` are sent only by jobs that asked for them, so they are
    # read from the answer's extra fields (an older answer parses unchanged).
    @property
    def evaluation(self) -> Evaluation | None:
        doc = (self.model_extra or {}).get("evaluation")
        return Evaluation.model_validate(doc) if doc is not None else None

    @property
    def sweep(self) -> SweepSummary | None:
        doc = (self.model_extra or {}).get("sweep")
        return SweepSummary.model_validate(doc) if doc is not None else None


class WebhookDelivery(_Answer):
    """Delivery of the job's signed webhook (docs/api.md, Webhooks).

    ``last_status`` is the HTTP status of the last attempt's answer as text (``"200"``,
    ``"503"``), or what kept it from getting one (``"connect_error"``, ``"tls_error"``,
    ``"timeout"``, ``"refused_address"``, ...). ``delivered_at`` is set once a receiver
    answered 2xx.
    """

    attempts: int = 0
    last_status: str | None = None
    delivered_at: str | None = None


class QueuePlace(_Answer):
    """A queued job's place: ``position`` jobs can start before it (0: it is next), and
    about ``eta_s`` seconds until it starts, from its pool's recent throughput (null
    until the pool has finished a job)."""

    position: int = 0
    eta_s: float | None = None
    pool: str | None = None


class Job(_Answer):
    id: str
    status: StatusText
    stage: str | None = None
    progress: Progress = Field(default_factory=Progress)
    method: str = ""
    name: str | None = None
    recipe: dict[str, Any] = Field(default_factory=dict)
    # Recipe fields the merge accepts and does not use (mergekit ignores them too), and
    # what the merge decided that the recipe does not say, one line each.
    warnings: list[str] = Field(default_factory=list)
    created_at: str = ""
    started_at: str | None = None
    finished_at: str | None = None
    attempts: int = 0
    cancel_requested: bool = False
    artifact_reused: bool | None = None
    error: ErrorBody | None = None
    result: JobResult | None = None
    callback_url: str | None = None
    webhook: WebhookDelivery | None = None
    # Kept past the service's retention period until unpinned or deleted.
    pinned: bool = False
    # Scheduling (docs/scheduling.md). ``priority``: low, normal or high. ``pool``: the
    # worker pool the job was routed to; ``ran_pool``: the pool of the worker that ran
    # it (the same, or a larger one that covers it). ``estimate``: what routing assumed
    # (host_memory_bytes, gpu_memory_bytes, disk_bytes, cost); ``measured``: the last
    # attempt's peak_rss_bytes. ``queue``: while queued, {position, eta_s, pool}.
    priority: str = "normal"
    pool: str | None = None
    ran_pool: str | None = None
    estimate: dict[str, Any] | None = None
    measured: dict[str, Any] | None = None
    queue: QueuePlace | None = None

    @property
    def done(self) -> bool:
        return self.status in TERMINAL


class JobPage(_Answer):
    """One page of ``GET /v1/jobs``, newest first; pass ``next_cursor`` for the next."""

    jobs: list[Job]
    next_cursor: str | None = None


class FileList(_Answer):
    """``GET /v1/jobs/{id}/files``: what the job published, from its manifest (the
    manifest itself last). Empty until the job has succeeded; ``status`` says where it is."""

    job_id: str
    status: StatusText
    files: list[FileInfo] = Field(default_factory=list)


class QueueCounts(_Answer):
    """The caller's jobs the scheduler holds: queued, running, and the units of work
    (a sweep's candidates count each) the running ones take of the caller's share."""

    queued: int = 0
    running: int = 0
    running_cost: int = 0


class QueuedJob(_Answer):
    """One of the caller's queued jobs and its place (as a queued job's ``queue`` says)."""

    id: str
    name: str | None = None
    priority: str = "normal"
    position: int = 0
    eta_s: float | None = None
    pool: str | None = None


class PoolLoad(_Answer):
    """One worker pool: its queued jobs (every key's, counted), active jobs, live
    workers, the median seconds of its recent jobs (null until one finished), and what
    each of its workers can hold (GiB; null: no limit)."""

    queued: int = 0
    active: int = 0
    workers: int = 0
    median_job_s: float | None = None
    host_memory_gib: float | None = None
    gpu_memory_gib: float = 0.0
    disk_gib: float | None = None


class QueueSummary(_Answer):
    """``GET /v1/queue``: the caller's own jobs (counts, and each queued one with its
    place, at most 100) and every pool's load; never another key's jobs."""

    key: str
    # The scheduler's policy (MAEC_SCHEDULER_POLICY): fair share between keys, or fifo.
    policy: str = ""
    jobs: QueueCounts = Field(default_factory=QueueCounts)
    queued: list[QueuedJob] = Field(default_factory=list)
    pools: dict[str, PoolLoad] = Field(default_factory=dict)
