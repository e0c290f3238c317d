"""What a succeeded attempt leaves: the job's result as the contract shapes it, and the
bookkeeping the record keeps beside it. Its own module, so every kind of job (a merge,
an MoE build) ends the same way without importing the runner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from maec_contract import JobResult


@dataclass(frozen=True)
class Finished:
    """A succeeded attempt: the job's result as the contract shapes it, and what the
    record keeps beside it (bookkeeping no caller sees)."""

    result: JobResult
    # The storage prefix the files were published under.
    prefix: str
    artifact_reused: bool | None

    @property
    def nbytes(self) -> int:
        """Bytes published (every file, the manifest and candidates included)."""
        return sum(f.size for f in self.result.files)

    def fields(self) -> dict[str, Any]:
        """The job record's fields this success sets."""
        n = len(self.result.files)
        return {"result": stored_result(self.result), "result_prefix": self.prefix,
                "artifact_reused": self.artifact_reused,
                "progress": {"fraction": 1.0, "done": n, "total": n}}


def stored_result(result: JobResult) -> dict[str, Any]:
    """``result`` as the job record keeps it: files without their URLs, which the API
    adds when it answers (``maec_contract.with_file_urls``), so the record does not
    depend on the route it is served under."""
    doc = result.model_dump(mode="json")
    doc["files"] = [{k: v for k, v in f.items() if k != "url" or v} for f in doc["files"]]
    return doc
