"""Scoring a sweep's candidates with one model object, its weights swapped per candidate.

Every candidate of a sweep has the same architecture, config and tokenizer (they are
merges of the same inputs), so the model is built once (``load_model``, as a one-off
evaluation builds it) and each later candidate's tensors are copied into it: one model
in memory at a time, and no per-candidate model construction. The scores are those a
fresh load gives (the bench checks it against separate evaluations).
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Any

import torch

from maec_core.errors import CheckpointError
from maec_core.eval.report import ModelResult
from maec_core.eval.runner import LoadedModel, evaluate_set, load_model
from maec_core.eval.sets import LoadedSet
from maec_core.io.folder import open_model_folder
from maec_core.runtime import CancelFn, ProgressFn


class ModelSlot:
    """Holds at most one loaded model; ``score`` puts a candidate folder's weights in it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.loaded: LoadedModel | None = None
        self._config: dict[str, Any] | None = None

    def _load(self, folder: Path) -> LoadedModel:
        config = json.loads((folder / "config.json").read_text())
        config.pop("dtype", None)
        config.pop("torch_dtype", None)
        if self.loaded is None or config != self._config:
            self.close()
            self.loaded, self._config = load_model(folder, self.device), config
            return self.loaded
        from safetensors.torch import load_file

        model = self.loaded.model
        expected = set(model.state_dict())
        seen: set[str] = set()
        with torch.no_grad():
            for path in open_model_folder(folder).weight_files:
                tensors = load_file(str(path), device=str(self.device))
                unknown = set(tensors) - expected
                if unknown:
                    raise CheckpointError(f"{folder}: tensors the model does not have: "
                                          f"{sorted(unknown)[:3]}", path=str(folder))
                model.load_state_dict(tensors, strict=False)
                seen |= set(tensors)
                del tensors
        # Tied weights (lm_head = embeddings) are stored once; nothing else may be absent.
        missing = {k for k in expected - seen
                   if not k.endswith("lm_head.weight") and "rotary" not in k}
        if missing:
            raise CheckpointError(f"{folder}: tensors missing: {sorted(missing)[:3]}",
                                  path=str(folder))
        return self.loaded

    def score(self, label: str, folder: Path, sets: list[LoadedSet],
              progress: ProgressFn | None, cancel: CancelFn | None) -> ModelResult:
        t0 = time.perf_counter()
        loaded = self._load(folder)
        results = [evaluate_set(loaded, s, progress=progress, cancel=cancel, stage=label)
                   for s in sets]
        return ModelResult(label=label, model_dir=str(folder), device=str(self.device),
                           dtype=loaded.dtype, seconds=time.perf_counter() - t0,
                           sets=results)

    def close(self) -> None:
        """Drop the model (before the next different one loads, and at the end)."""
        if self.loaded is not None:
            self.loaded = None
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
