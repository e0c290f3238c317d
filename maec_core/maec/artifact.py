"""The sparse ability-vector artifact: one safetensors file plus JSON metadata.

Layout of an artifact folder::

    ability.safetensors   per included tensor T with key neurons:
                            "T::index"  int64 kept row indices, ascending (granularity row)
                                        or int32/int64 flat element indices (element)
                            "T::delta"  R(A) on those rows, shape (k, *T.shape[1:]),
                                        or (k,) values (element), in artifact_dtype
    ability.json          format, key, key document (input checksums, parameters),
                          per-tensor shapes and score statistics, the file's sha256

Nothing in either file depends on paths or time, so the same inputs give the same
bytes and the folder can be stored under its content-addressed key anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from maec_core.artifact_store import META_NAME
from maec_core.checksums import sha256_file
from maec_core.errors import ArtifactMismatch, CorruptCheckpoint
from maec_core.io.folder import load_json
from maec_core.io.headers import TensorInfo, read_header
from maec_core.maec.keys import ARTIFACT_FORMAT, ARTIFACT_FORMAT_VERSION, key_of
from maec_core.maec.params import MaecParams
from maec_core.maec.rowio import RowReader
from maec_core.plan import PlannedTensor

WEIGHTS_NAME = "ability.safetensors"
INDEX_SUFFIX = "::index"
DELTA_SUFFIX = "::delta"


def index_dtype(granularity: str, numel: int) -> str:
    """Row indices are few (int64 costs nothing); element indices use int32 when they fit."""
    return "I32" if granularity == "element" and numel < 2**31 else "I64"


def delta_shape(granularity: str, shape: tuple[int, ...], kept: int) -> tuple[int, ...]:
    if granularity == "element":
        return (kept,)
    return (kept, *shape[1:]) if len(shape) > 1 else (kept,)


@dataclass(frozen=True)
class ArtifactTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str  # the checkpoints' safetensors dtype of this tensor
    candidates: int
    kept: int
    score: dict[str, float]
    index: TensorInfo
    delta: TensorInfo


@dataclass
class Artifact:
    """An opened, verified artifact folder."""

    folder: Path
    meta: dict[str, Any]
    tensors: dict[str, ArtifactTensor]

    @property
    def key(self) -> str:
        return str(self.meta["key"])

    @property
    def granularity(self) -> str:
        return str(self.meta["key_document"]["parameters"]["granularity"])

    def read(self, name: str, reader: RowReader) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 indices, float32 R(A) values) of tensor ``name``, on CPU."""
        t = self.tensors[name]
        return reader.read(t.index).to(torch.int64), reader.read(t.delta).float()


def load_artifact(folder: str | Path, *, verify: bool = True,
                  hash_cache: Path | None = None) -> Artifact:
    """Open an artifact folder; check its format, header and (``verify``) file sha256."""
    root = Path(folder)
    if not (root / META_NAME).is_file() or not (root / WEIGHTS_NAME).is_file():
        raise ArtifactMismatch(
            f"{root} is not an ability-vector artifact (needs {META_NAME} and {WEIGHTS_NAME})",
            path=str(root),
        )
    meta = load_json(root / META_NAME, what=f"artifact {META_NAME}")
    if meta.get("format") != ARTIFACT_FORMAT:
        raise ArtifactMismatch(f"{root}/{META_NAME} is not a {ARTIFACT_FORMAT} file")
    if meta.get("format_version") != ARTIFACT_FORMAT_VERSION:
        raise ArtifactMismatch(
            f"artifact format version {meta.get('format_version')} is not the supported "
            f"{ARTIFACT_FORMAT_VERSION}; extract it again",
        )
    doc = meta.get("key_document")
    if not isinstance(doc, dict) or key_of(doc) != meta.get("key"):
        raise CorruptCheckpoint(f"artifact {root}: key does not match its key document")
    file_doc = meta.get("file") or {}
    weights = root / WEIGHTS_NAME
    if file_doc.get("size") != weights.stat().st_size or (
        verify and sha256_file(weights, cache=hash_cache) != file_doc.get("sha256")
    ):
        raise CorruptCheckpoint(
            f"artifact {root}: {WEIGHTS_NAME} does not match the size/sha256 in {META_NAME}"
        )
    header = read_header(weights)
    granularity = str(doc["parameters"]["granularity"])
    tensors: dict[str, ArtifactTensor] = {}
    for entry in meta.get("tensors", []):
        name, kept = str(entry["name"]), int(entry["kept"])
        shape = tuple(int(d) for d in entry["shape"])
        if kept == 0:
            continue
        index = header.tensors.get(name + INDEX_SUFFIX)
        delta = header.tensors.get(name + DELTA_SUFFIX)
        if (
            index is None
            or delta is None
            or index.shape != (kept,)
            or delta.shape != delta_shape(granularity, shape, kept)
        ):
            raise CorruptCheckpoint(f"artifact {root}: tensor {name!r} is missing or malformed")
        tensors[name] = ArtifactTensor(
            name, shape, str(entry["dtype"]), int(entry["candidates"]), kept,
            dict(entry["score"]), index, delta,
        )
    return Artifact(root, meta, tensors)


def check_compatible(
    artifact: Artifact,
    *,
    base_checksums: dict[str, str],
    params: MaecParams,
    checkpoint_dtype: str,
    tensors: dict[str, PlannedTensor],
    label: str,
) -> None:
    """Refuse to combine ``artifact`` with a base it was not extracted from."""
    doc = artifact.meta["key_document"]
    if doc["inputs"]["base"] != base_checksums:
        raise ArtifactMismatch(
            f"{label}: artifact {artifact.key[:12]} was extracted from a different base model "
            "θ0 (weight-file checksums differ); extract the ability against this base_model",
            artifact_key=artifact.key,
        )
    want = params.extraction_dict(checkpoint_dtype)
    have = doc["parameters"]
    diff = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
    if diff:
        listing = ", ".join(f"{k}: artifact {have.get(k)!r} vs recipe {want.get(k)!r}"
                            for k in diff)
        raise ArtifactMismatch(
            f"{label}: artifact {artifact.key[:12]} was extracted with other parameters "
            f"({listing})",
            artifact_key=artifact.key, parameters=diff,
        )
    for t in artifact.tensors.values():
        planned = tensors.get(t.name)
        if planned is None:
            raise ArtifactMismatch(
                f"{label}: artifact tensor {t.name!r} is not in the language base",
                artifact_key=artifact.key, tensor=t.name,
            )
        if planned.shape != t.shape:
            raise ArtifactMismatch(
                f"{label}: artifact tensor {t.name!r} has shape {list(t.shape)} but the "
                f"language base has {list(planned.shape)}",
                artifact_key=artifact.key, tensor=t.name,
            )
