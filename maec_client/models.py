"""Pydantic shapes of the REST contract (docs/api.md), as the client reads them.

Responses are parsed leniently (``extra="allow"``): a newer service may add fields and an
older client must keep working. Request bodies are strict (``extra="forbid"``) so a typo
in a caller's kwargs fails here rather than as a 422 round trip.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

JobStatus = Literal["queued", "running", "publishing", "succeeded", "failed", "cancelled"]
TERMINAL: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class Progress(_Lenient):
    fraction: float = 0.0
    done: int = 0
    total: int = 0


class JobErrorInfo(_Lenient):
    code: str
    message: str = ""
    details: dict[str, Any] = Field(default_factory=dict)


class FileInfo(_Lenient):
    path: str
    size: int
    sha256: str
    url: str | None = None


class JobResult(_Lenient):
    manifest: dict[str, Any] = Field(default_factory=dict)
    report: dict[str, Any] = Field(default_factory=dict)
    files: list[FileInfo] = Field(default_factory=list)
    core_seconds: float | None = None


class Job(_Lenient):
    id: str
    # str rather than JobStatus: an unknown future status must not make every get() fail.
    status: str
    stage: str | None = None
    progress: Progress = Field(default_factory=Progress)
    method: str | None = None
    name: str | None = None
    recipe: dict[str, Any] | None = None
    created_at: str | None = None
    started_at: str | None = None
    finished_at: str | None = None
    attempts: int = 0
    cancel_requested: bool = False
    artifact_reused: Any = None
    error: JobErrorInfo | None = None
    result: JobResult | None = None

    @property
    def done(self) -> bool:
        return self.status in TERMINAL


class JobPage(_Lenient):
    jobs: list[Job]
    next_cursor: str | None = None


class NamedJob(BaseModel):
    """Body form 1: named checkpoints (the service turns it into a recipe)."""

    model_config = ConfigDict(extra="forbid")

    method: str
    base: str | None = None
    ability_donor: list[str] = Field(default_factory=list)
    language_base: str | None = None
    source_control: str | None = None
    ability_corpus: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)
    dtype: str | None = None
    shard_size: str | int | None = None
    idempotency_key: str | None = None
    name: str | None = None

    @field_validator("ability_donor", mode="before")
    @classmethod
    def _one_donor(cls, v: Any) -> Any:
        # The service accepts a single donor as a plain string; so does the client.
        return [v] if isinstance(v, str) else v

    def body(self) -> dict[str, Any]:
        # Unset optionals are left out so the service's defaults apply (shard_size "5GB").
        return self.model_dump(mode="json", exclude_none=True)
