"""The registry of job kinds: which kind runs a job record (the interface:
``worker.job_kind``), by the name the API's registry gives the record's kind
(``app.kinds.kind_name``): which kind owns a record is decided there once. A new kind is
its own module and one entry here."""

from __future__ import annotations

from app.jobs.record import JobRecord
from app.kinds import kind_name
from worker.job_kind import JobKind
from worker.moe import MOE
from worker.stages import MERGE

# By the contract's ``kind``, as ``app.kinds.KINDS``.
KINDS: dict[str, JobKind] = {"moe": MOE, "merge": MERGE}


def kind_of(rec: JobRecord) -> JobKind:
    """The kind that runs ``rec``."""
    return KINDS[kind_name(rec)]
