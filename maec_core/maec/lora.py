"""A MAEC ability vector as a PEFT LoRA adapter (``maec extract-lora``).

The artifact's sparse delta (weight 1), made dense one tensor at a time and factored by
the LoRA export's truncated SVD (:mod:`maec_core.lora.export`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from maec_core.context import RunContext
from maec_core.io.output import StagedOutput
from maec_core.lora.export import factor_all, publish, select_targets, write_adapter
from maec_core.maec.artifact import Artifact, load_artifact
from maec_core.maec.rowio import RowReader


def _artifact_deltas(art: Artifact, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The ability vector's dense delta for each name (zero off its key neurons)."""
    with RowReader() as reader:
        for name in names:
            t = art.tensors[name]
            idx, values = art.read(name, reader)
            dense = torch.zeros(t.shape, dtype=torch.float32)
            if art.granularity == "element":
                dense.view(-1)[idx] = values.reshape(-1)
            else:
                dense[idx] = values.reshape(len(idx), *t.shape[1:])
            yield name, dense


def export_artifact(
    artifact_dir: Path,
    out: Path,
    ctx: RunContext,
    rank: int,
    *,
    target_modules: list[str] | None = None,
    base_ref: str | None = None,
) -> dict[str, Any]:
    """Publish at ``out`` the adapter approximating a MAEC ability vector (the artifact's
    sparse delta, weight 1); returns the report. Of ``ctx`` the progress, device and
    overwrite apply (an export is not cancelled)."""
    art = load_artifact(artifact_dir)
    names = select_targets(((n, t.shape) for n, t in art.tensors.items()), target_modules)
    with StagedOutput(out, overwrite=ctx.overwrite) as staged:
        factors = factor_all(_artifact_deltas(art, names), len(names), rank,
                              ctx.but(cancel=None))
        report = write_adapter(staged, factors, rank, base_ref, None, torch.float32)
        report["artifact_key"] = art.key
        publish(staged, report, None, {"artifact": {"path": str(artifact_dir),
                                                   "key": art.key}})
        staged.commit()
    return report
