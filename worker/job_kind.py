"""The interface every kind of job implements (the registry: ``worker.kinds``).

A job record asks for one kind of output: a merge (a recipe: merge, evaluate or sweep) or
an MoE build (a mergekit-moe config). Each kind lives in its own module and answers the
same two questions: :meth:`JobKind.plan` (from the record: the stage spans, which inputs
are one file, the checks on the fetched inputs) and :meth:`Planned.produce` (the inputs
fetched: make the output folder and its manifest, in memory). The runner does the rest
alike for every kind: fetch, then produce, then reserve and publish, manifest last
(``worker.runner``).

A new kind (an eval-only job, say), named by the contract's ``kind``, touches:

- ``maec_contract.requests``: its body model (a ``KindRequest`` with its ``KIND``) and
  one entry in ``OTHER_KINDS`` (the request union and the API's body schema are made
  from it), since the contract publishes every body and imports nothing of ours;
- its module in ``app.kinds`` (which records it owns, what it reads at submission) and
  one entry in ``app.kinds.KINDS``;
- its module here (a :class:`JobKind`: the record's plan and its produce step) and one
  entry in ``worker.kinds.KINDS`` under the same name.

Nothing else: submission, routing, the runner's fetch, reserve and publish, the job's
file URLs and the UI are the same for every kind.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from app.jobs.record import JobRecord
from maec_core.service import FileEntry, Manifest, StageSpans
from maec_core.service.running import RunContext

# upload(path under the job's prefix, local file): one file into the job's staging
# prefix, counted against the owner's quota first (a sweep's candidates).
Upload = Callable[[str, Path], None]


class Reporter(Protocol):
    """The attempt's progress writer (``worker.runner.Attempt``)."""

    def report(self, stage: str, fraction: float, done: int, total: int,
               **extra: Any) -> None: ...


@dataclass(frozen=True)
class Run:
    """What the runner gives a kind's produce step.

    ``local`` maps each input reference to its fetched copy; ``out`` is the output folder
    to make; ``ctx`` says how to run (the job's progress and cancel, the input-digest
    cache, the artifact store, the device, the output's finished-shard callbacks, which
    upload the shards as they are written). ``reporter`` writes progress fields of the
    kind's own (a sweep's candidate); ``upload`` stores a file beside the output.
    ``digests``: input files' sha256 the manifest names without hashing them.
    """

    local: Mapping[str, str]
    out: Path
    workdir: Path
    ctx: RunContext
    reporter: Reporter
    upload: Upload
    # Input files' sha256 known without their whole bytes (reference -> file name ->
    # hex): inputs held in part (worker.partial); the manifest names these.
    digests: Mapping[str, Mapping[str, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Made:
    """What a kind made: the output folder's manifest (as clients read it, not written
    yet: the runner writes it once, last), the job's report (inputs named by their
    references), the result fields the job gains (``evaluation``, ``sweep``) and the
    files already uploaded through :attr:`Run.upload`."""

    manifest: Manifest
    report: dict[str, Any]
    core_seconds: float
    result: dict[str, Any] = field(default_factory=dict)
    uploaded: tuple[FileEntry, ...] = ()
    # Whether every ability artifact was reused (None: the job has none).
    artifact_reused: bool | None = None


class Planned(Protocol):
    """One job of a kind, planned from its record."""

    @property
    def spans(self) -> StageSpans:
        """How the job's stages share its progress."""

    @property
    def resumable(self) -> bool:
        """Whether a later attempt may keep the output shards this one publishes
        (``worker.resume``)."""

    def one_file(self, ref: str) -> bool:
        """Whether input ``ref`` is read as one file (else a checkpoint folder)."""

    def check(self, local: Mapping[str, str]) -> None:
        """Raise a MaecError when the fetched inputs (``local``) cannot be used."""

    def produce(self, run: Run) -> Made:
        """Make the output in ``run.out``."""


class JobKind(Protocol):
    """A kind of job: the plan of a record of its kind (which records are of its kind
    is the API's registry's to say, ``app.kinds``)."""

    def plan(self, rec: JobRecord) -> Planned: ...
