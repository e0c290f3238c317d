"""One job as stored in Redis: a hash whose every field holds a JSON value.

A hash (not one JSON string) so that progress writes and state transitions touch only
their fields, atomically, from Lua; reading a job is still one ``HGETALL``.
"""

from __future__ import annotations

import json
import secrets
import time
from datetime import UTC, datetime
from typing import Any

from pydantic import ConfigDict, Field
from pydantic_core import PydanticSerializationError

from maec_contract import STATUSES as STATUSES  # re-exported: the store and API use it
from maec_contract import TERMINAL as TERMINAL
from maec_contract import Job, with_file_urls
from maec_contract import JobStatus as Status
from maec_core.service import MaecError

ACTIVE: frozenset[str] = frozenset({"queued", "running", "publishing"})


def new_job_id() -> str:
    """``j_`` + 12 hex digits of milliseconds + random: ids sort by creation time, so a
    per-owner sorted set read lexicographically lists newest first without a score."""
    return f"j_{int(time.time() * 1000):012x}{secrets.token_hex(6)}"


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JobRecord(Job):
    """The contract's :class:`~maec_contract.Job` (its fields, in its order: the store
    assembles a served body in record order) and the bookkeeping the service keeps
    beside it, never shown (:data:`INTERNAL_FIELDS`).

    Only what the record holds differently is declared again: a status the service
    writes is one of the statuses; a job always has its method, recipe and creation time;
    ``error``, ``result`` and ``queue`` stay the JSON they were stored as, so what a
    record serves (a webhook body, a changed job) is byte for byte what was stored, not a
    re-dump with a newer model's defaults filled in."""

    # Unlike a client reading an answer, the store drops fields it no longer knows
    # rather than serving them.
    model_config = ConfigDict(extra="ignore")

    owner: str
    status: Status = "queued"
    method: str
    recipe: dict[str, Any]
    created_at: str
    error: dict[str, Any] | None = None  # type: ignore[assignment]
    result: dict[str, Any] | None = None  # type: ignore[assignment]
    queue: dict[str, Any] | None = None  # type: ignore[assignment]
    # Every source the recipe names, as the worker will fetch it (kind, uri, ...).
    sources: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # Units of work against the owner's fair share (a sweep's candidates), and the
    # job's place in the scheduler's order (set when queued).
    cost: int = 1
    seq: int = 0
    idempotency_key: str | None = None
    lease_until: float = 0.0
    # Epoch seconds the current attempt was claimed: an expired lease on an attempt
    # older than the time limit means Celery's hard limit killed it (not a crash).
    attempt_started: float = 0.0
    worker: str | None = None
    # Storage prefix the result files were published under (attempt-specific).
    result_prefix: str | None = None
    # Bytes this job's outputs count against its owner's storage quota: reserved before
    # publishing, released when the attempt fails or the job is deleted or expires.
    published_bytes: int = 0
    # Ability artifacts the published outputs were made from (kept while referenced).
    artifact_keys: list[str] = Field(default_factory=list)
    # A merge's output shards as they landed, and the prefix they lie under: what the
    # next attempt resumes from (worker/resume.py).
    shards: dict[str, Any] | None = None

    def public(self) -> dict[str, Any]:
        """The Job object of the API contract (maec_contract.Job), bookkeeping left out,
        as the API answers it: its files with their URLs."""
        doc = self.model_dump(mode="json", exclude=set(INTERNAL_FIELDS))
        if isinstance(doc.get("result"), dict):
            doc["result"] = with_file_urls(doc["result"], self.id)
        return doc


# The contract decides what callers see; every other record field is bookkeeping, never
# shown. The public fields keep the contract's order (the store assembles bodies in
# record order), which tests/client/test_contract.py checks.
INTERNAL_FIELDS: tuple[str, ...] = tuple(f for f in JobRecord.model_fields
                                         if f not in Job.model_fields)


def encode(fields: dict[str, Any]) -> dict[str, str]:
    return {k: json.dumps(v, separators=(",", ":")) for k, v in fields.items()}


class UnstorableRecord(MaecError):
    """A new job record holds what JSON cannot carry to a reader: a lone UTF-16
    surrogate, a NaN or infinity, or nesting too deep to serialise. Refused before it is
    stored (submission refuses such bodies earlier; this is the store's own guard)."""

    code = "invalid_request"


def storable_fields(record: JobRecord, exclude: set[str] | None = None) -> dict[str, Any]:
    """The record's fields as JSON values, serialised strictly once (UTF-8 that every
    reader decodes, finite numbers) so that nothing stored can fail to be sent later.
    Raises UnstorableRecord.

    The store keeps each field as ASCII JSON (``json.dumps``' escapes), which would
    write a lone surrogate as a ``\\ud800`` escape without complaint and make every later
    read of the job fail to encode; hence this strict pass before the record exists."""
    try:
        # The Python values are checked, not the JSON-mode dump: that one quietly turns
        # a lone surrogate in a dict key into U+FFFD, changing what was asked for.
        json.dumps(record.model_dump(exclude=exclude), ensure_ascii=False,
                   allow_nan=False).encode("utf-8")
        fields = record.model_dump(mode="json", exclude=exclude)
    except (PydanticSerializationError, UnicodeEncodeError, ValueError, RecursionError) as exc:
        # The exception's own text may quote the offending value: not repeated.
        raise UnstorableRecord(f"the job cannot be stored: its record is not strict JSON "
                               f"({type(exc).__name__})", job_id=record.id) from None
    return fields


def text(value: bytes | str | int | float) -> str:
    """A Redis reply as text: the one place the store decodes bytes. Its clients return
    bytes so that the polled job read can pass the stored JSON through undecoded."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _value(raw: bytes | str) -> Any:
    # Bytes that are not UTF-8 (never written by this store) decode to lone surrogates
    # rather than raising, so such a record can still be read, cancelled and deleted; the
    # API's strict serialisation shows it degraded (app/jobs/api_store.py).
    return json.loads(raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes)
                      else raw)


def decode(raw: dict[bytes, bytes] | dict[str, str]) -> JobRecord | None:
    if not raw:
        return None
    return JobRecord.model_validate({text(k): _value(v) for k, v in raw.items()})
