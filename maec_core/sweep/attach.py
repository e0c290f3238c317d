"""Add files to a published checkpoint folder and keep its manifest true (torch-free).

A merged folder's ``manifest.json`` lists every file with its size and sha256; evaluation
adds ``eval_report.json`` (and a sweep ``leaderboard.json`` and ``sweep.png``) and
rewrites the model card, so each change goes through :func:`amend`, which updates the
folder's manifest (given in memory, or read from the folder) and writes it last, as the
merge wrote it, unless the caller writes it itself (once, after naming the inputs).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maec_core.card import evaluation_section, with_evaluation
from maec_core.eval.report import EvalReport
from maec_core.manifest import MANIFEST_NAME, FileEntry, write_manifest
from maec_core.naming import renamed
from maec_core.sweep.board import LEADERBOARD_NAME, Leaderboard

EVAL_REPORT_NAME = "eval_report.json"
PLOT_NAME = "sweep.png"
CARD_NAME = "README.md"


def read_manifest(folder: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((folder / MANIFEST_NAME).read_text())
    return doc


@dataclass(frozen=True)
class Amended:
    """A folder after :func:`amend`: its manifest as it now stands, and the entries of
    the files written (added, or replacing the merge's)."""

    manifest: dict[str, Any]
    added: tuple[FileEntry, ...]


def amend(folder: Path, files: Mapping[str, bytes], extra: Mapping[str, Any] | None = None,
          *, manifest: Mapping[str, Any] | None = None, write: bool = True) -> Amended:
    """Write ``files`` (name -> bytes) into ``folder`` and update its manifest (entries,
    total size, ``extra`` keys): ``manifest`` when given, else the folder's. With
    ``write`` False the manifest is only returned (the caller writes it)."""
    doc = dict(manifest) if manifest is not None else read_manifest(folder)
    entries = {f["path"]: f for f in doc["files"]}
    added = []
    for name, data in files.items():
        tmp = folder / f".{name}.partial"
        tmp.write_bytes(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, folder / name)
        added.append(FileEntry(name, len(data), hashlib.sha256(data).hexdigest()))
        entries[name] = added[-1].to_json()
    doc["files"] = [entries[k] for k in sorted(entries)]
    doc["total_size"] = sum(int(f["size"]) for f in doc["files"])
    doc.update(extra or {})
    if write:
        write_manifest(folder, doc)
    return Amended(doc, tuple(added))


def report_bytes(report: EvalReport) -> bytes:
    return (json.dumps(report.model_dump(mode="json"), indent=1, ensure_ascii=False)
            + "\n").encode()


def published_report(report: EvalReport, names: Mapping[str, str]) -> EvalReport:
    """``report`` as a job publishes it (``names``: local copy -> reference, a job's
    ``RunContext.names``; empty: a local run, whose paths are the user's own): each input
    and eval set named by its reference, and a model that is no input (the merged
    folder, a sweep's candidates, made in the worker's temporary folders) by no path."""
    if not names:
        return report
    doc = renamed(report.model_dump(mode="json"), names)
    refs = set(names.values())
    for model in doc["models"]:
        if model["model_dir"] not in refs:
            model["model_dir"] = None
    return EvalReport.model_validate(doc)


def attach_evaluation(folder: Path, report: EvalReport, *, label: str,
                      board: Leaderboard | None = None, plot: bytes | None = None,
                      manifest: Mapping[str, Any] | None = None, write: bool = True,
                      names: Mapping[str, str] | None = None) -> Amended:
    """Publish ``report`` (and a sweep's board and plot) in ``folder``: the files, the
    card's evaluation section, and the manifest (``manifest`` and ``write``: see
    :func:`amend`). ``label`` is this folder's row; ``names``: see
    :func:`published_report`."""
    report = published_report(report, names or {})
    files: dict[str, bytes] = {EVAL_REPORT_NAME: report_bytes(report)}
    note = f"This checkpoint is the row `{label}`."
    section = evaluation_section(report.markdown_table(), note=note)
    if board is not None:
        files[LEADERBOARD_NAME] = (json.dumps(board.model_dump(mode="json"), indent=1)
                                   + "\n").encode()
        section = evaluation_section(report.markdown_table(), note=note,
                                     leaderboard_markdown=board.markdown(), why=board.why)
    if plot is not None:
        files[PLOT_NAME] = plot
    card = folder / CARD_NAME
    if card.is_file():
        files[CARD_NAME] = with_evaluation(card.read_text(), section).encode()
    extra: dict[str, Any] = {"evaluation": {
        "report": EVAL_REPORT_NAME, "label": label,
        "sets": [c.name for c in report.columns]}}
    if board is not None:
        extra["sweep"] = {"leaderboard": LEADERBOARD_NAME, "winner": board.winner,
                          "candidate": label}
    return amend(folder, files, extra, manifest=manifest, write=write)
