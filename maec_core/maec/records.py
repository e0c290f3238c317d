"""The texts a split MAEC merge keeps between its phases (``maec_core.maec.phases``).

All JSON, floats written as Python writes them (the shortest text that reads back as
the same float), so a c_t read back is the one measured, bit for bit:

- the *found* record (before the parts): each ability's artifact key, whether it was
  reused from the store (not extracted by this merge) and the seconds extraction took;
- a scoring part's *cosines*: per ability, c_t of the tensors of its shards;
- the *selection* record (once, from every part's cosines): per ability, every c_t and
  the tensors kept.

A text that does not read as its record fails with ``artifact_mismatch``: they are
the service's own, so that means a store that lost or mixed them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from maec_core.errors import ArtifactMismatch
from maec_core.maec.combine import Selection


@dataclass(frozen=True)
class Found:
    """The ability vectors a split merge combines: their keys in ability order, whether
    each was reused, and the seconds the extraction before the parts took."""

    keys: list[str]
    reused: list[bool]
    extract_seconds: float = 0.0

    def dump(self) -> str:
        return json.dumps({"artifact_keys": self.keys, "reused": self.reused,
                           "extract_seconds": self.extract_seconds})

    @classmethod
    def load(cls, text: str) -> Found:
        doc = _doc(text, "artifact_keys", "reused")
        keys, reused = doc["artifact_keys"], doc["reused"]
        if not (isinstance(keys, list) and isinstance(reused, list)
                and len(keys) == len(reused) and all(isinstance(k, str) for k in keys)):
            raise ArtifactMismatch("the split merge's record of its ability vectors is "
                                   "not readable")
        return cls(keys, [bool(r) for r in reused], float(doc.get("extract_seconds", 0.0)))


def dump_cosines(cosines: Sequence[dict[str, float]]) -> str:
    return json.dumps({"cosines": list(cosines)})


def load_cosines(text: str) -> list[dict[str, float]]:
    return _cosines(_doc(text, "cosines")["cosines"])


def dump_selection(selection: Selection) -> str:
    return json.dumps({"cosines": selection.cosines,
                       "kept": [sorted(k) for k in selection.kept]})


def load_selection(text: str) -> Selection:
    doc = _doc(text, "cosines", "kept")
    cosines, kept = _cosines(doc["cosines"]), doc["kept"]
    if not isinstance(kept, list) or len(kept) != len(cosines) or not all(
            isinstance(k, list) for k in kept):
        raise ArtifactMismatch("the split merge's selection record is not readable")
    return Selection(cosines, [{str(n) for n in k} for k in kept])


def _cosines(value: Any) -> list[dict[str, float]]:
    if not isinstance(value, list) or not all(isinstance(cs, dict) for cs in value):
        raise ArtifactMismatch("the split merge's c_t record is not readable")
    return [{str(n): float(c) for n, c in cs.items()} for cs in value]


def _doc(text: str, *keys: str) -> dict[str, Any]:
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ArtifactMismatch(f"a split merge's record is not JSON: {exc}") from None
    if not isinstance(doc, dict) or any(k not in doc for k in keys):
        raise ArtifactMismatch(f"a split merge's record lacks {', '.join(keys)}")
    return doc
