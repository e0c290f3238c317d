"""Kinds of job as the API takes them: each turns its kind's request body into a
``Submission`` (what the job makes, checked before anything is queued), resolved by
the body's ``kind`` (the contract's discriminator). The worker's side of each kind is
``worker.kinds``, keyed by the same names. A new kind is its own module here and one
entry in ``KINDS`` (what else it touches: ``worker.job_kind``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from app.jobs.record import JobRecord
from app.kinds.merge import MERGE
from app.kinds.moe import MOE
from app.scheduler.estimate import Need
from app.settings import Settings
from app.sources import Published
from app.storage.base import Storage
from maec_contract import JobSubmission, request_kind

# Checked sources by reference (``Source.to_dict``), the job's needs, and what its plan
# warns of from the checkpoints' headers.
Checked = tuple[dict[str, dict[str, Any]], Need, list[str]]


class Submission(Protocol):
    """One job request as its kind reads it (a merge recipe, an MoE config)."""

    @property
    def method(self) -> str:
        """The method the job record names."""

    @property
    def name(self) -> str | None:
        """The name the recipe gives the job, if any."""

    def record_recipe(self) -> dict[str, Any]:
        """The recipe (or config) as the job record keeps it."""

    def warnings(self) -> list[str]:
        """What the recipe says that the job does not read, one line each."""

    def references(self) -> set[str]:
        """The ids of the jobs whose outputs the job reads (``job:<id>`` sources): the
        API looks each up with the caller's key before the sources are checked."""

    def check_sources(self, settings: Settings, storage: Storage,
                      outputs: Mapping[str, Published] | None = None) -> Checked:
        """Every source allow-listed, resolved and pinned, the job's needs (which route
        it to a pool) and its plan's warnings from the checkpoints' headers.
        ``outputs``: the caller's succeeded jobs among :meth:`references`."""


class Kind(Protocol):
    def owns(self, method: str) -> bool:
        """Whether a job record naming ``method`` is of this kind."""

    def inputs(self, recipe: dict[str, Any]) -> tuple[list[str], list[str]]:
        """(bases, donors) a record's recipe names, for the job list."""

    def submission(self, req: Any) -> Submission:
        """``req`` (this kind's request model) as a submission."""


# By the request's ``kind`` (the contract's name, which ``worker.kinds`` keys the same
# way). A kind registered later (a test's) is one more entry.
KINDS: dict[str, Kind] = {"moe": MOE, "merge": MERGE}
# The kind of a body that names none (a merge): it owns every record no other kind owns.
DEFAULT: str = request_kind({})


def kind_name(rec: JobRecord) -> str:
    """The name of a job record's kind: the kind that owns its method, else the
    default's. Decided here only; the worker runs the record by this name."""
    return next((name for name, k in KINDS.items()
                 if name != DEFAULT and k.owns(rec.method)), DEFAULT)


def record_kind(rec: JobRecord) -> Kind:
    """The kind of a job record."""
    return KINDS[kind_name(rec)]


def submission_of(req: JobSubmission) -> Submission:
    """What ``req`` asks for, read by its kind."""
    return KINDS[request_kind(req)].submission(req)
