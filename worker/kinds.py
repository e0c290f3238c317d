"""The registry of job kinds: which kind runs a job record (the interface:
``worker.job_kind``). A new kind is its own module and one entry here."""

from __future__ import annotations

from app.jobs.record import JobRecord
from worker.job_kind import JobKind
from worker.moe import MOE
from worker.stages import MERGE

# The first kind that owns a record runs it: a merge runs any recipe, so it comes last.
KINDS: tuple[JobKind, ...] = (MOE, MERGE)


def kind_of(rec: JobRecord) -> JobKind:
    """The kind that runs ``rec``."""
    return next(k for k in KINDS if k.owns(rec))
