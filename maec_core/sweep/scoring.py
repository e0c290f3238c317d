"""Scoring a sweep's candidates with one model object, its weights replaced per candidate.

Every candidate of a sweep has the same architecture, config and tokenizer (they are
merges of the same inputs with other numbers), so the model is built once and each
candidate is merged straight into its weights (:meth:`ModelSlot.sink`, the engine's
tensor sink): one model in memory at a time, no per-candidate model construction, and
no candidate written to disk and read back, not even the first. The first merge writes
only the model's definition files (config, generation config, tokenizer: the
engine's ``EngineOptions.skeleton``), and the model is built from those
(:func:`~maec_core.eval.loading.build_model`) as the merge starts, then filled by it.
A candidate that has a folder anyway (``publish: all``) is read from it
(:meth:`ModelSlot.load`). Either way the weights hold the bytes the candidate's
checkpoint holds, converted as a fresh load converts them, in a model built as a load
builds it, so the scores are those of a separate evaluation (the tests and the bench
check it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from maec_core.context import RunContext
from maec_core.errors import CheckpointError, MaecError, NamesDiffer
from maec_core.eval.loading import LoadedModel, build_model, load_model, release
from maec_core.eval.report import ModelResult
from maec_core.eval.runner import evaluate_set
from maec_core.eval.sets import LoadedSet
from maec_core.io.folder import open_model_folder
from maec_core.io.reader import TORCH_DTYPES
from maec_core.io.writer import OutputTensor, WrittenFile


def _targets(model: Any) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The model's stored tensors by checkpoint name (views sharing the weights'
    memory), less the second names of tied weights (``lm_head`` sharing the
    embeddings), whose values a fresh load ignores in favour of the first name's; and
    those second names."""
    params = dict(model.named_parameters())  # a shared parameter once, by its first name
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)
            if name not in params}
    state = {k: v for k, v in model.state_dict().items() if k not in tied}
    return state, tied


def check_names(model: Any, given: set[str], where: str) -> None:
    """A candidate giving the tensors ``given`` fits ``model``: nothing the model lacks,
    and every parameter given (a tied weight's second name may be absent, as a
    checkpoint stores it once, or present, and is then ignored). One check for both
    ways in (a merge's sink, a folder's load), run before any weight is touched."""
    state, tied = _targets(model)
    unknown = sorted(given - set(state) - tied)
    if unknown:
        raise NamesDiffer(f"{where} has tensors the model does not have: {unknown[:3]}")
    missing = sorted(set(dict(model.named_parameters())) - given)
    if missing:
        raise NamesDiffer(f"{where} lacks tensors the model has: {missing[:3]}")


class ModelSink:
    """A :class:`~maec_core.io.writer.TensorSink` copying each merged tensor, as the
    engine streams it, into the loaded model's weight of the same name.

    The bytes arrive in the checkpoint's dtype and are converted by ``copy_`` as a load
    converts them. Every name and shape is checked before the merge starts, so a
    mismatch costs no merge; a merge that fails half way leaves the weights mixed, so
    ``abort`` drops the model (``on_abort``).
    """

    def __init__(self, model: Any, outputs: list[OutputTensor],
                 on_abort: Callable[[], None]) -> None:
        check_names(model, {t.name for t in outputs}, "the candidate")
        state, _tied = _targets(model)
        for t in outputs:
            dst = state.get(t.name)
            if dst is not None and tuple(dst.shape) != t.shape:
                raise CheckpointError(f"tensor {t.name}: the candidate's shape {list(t.shape)} "
                                      f"is not the model's {list(dst.shape)}")
            if dst is not None and not dst.is_contiguous():
                # Parts are copied into a flat view of the weight, which needs one.
                raise CheckpointError(f"tensor {t.name}: the model's weight is not "
                                      "contiguous")
        self._state = state
        self._on_abort = on_abort
        self._flat: torch.Tensor | None = None  # the current tensor's weight, flat
        self._dtype = torch.float32
        self._at = 0  # elements of the current tensor copied so far
        self._skip = False

    def begin(self, name: str, shape: tuple[int, ...], dtype: str | None) -> None:
        if dtype not in TORCH_DTYPES:
            raise MaecError(f"tensor {name}: dtype {dtype} cannot be loaded")
        dst = self._state.get(name)
        # A tied weight's second name: a fresh load keeps the first name's values.
        self._skip = dst is None
        self._flat = None if dst is None else dst.view(-1)
        self._dtype = TORCH_DTYPES[dtype]
        self._at = 0

    def append(self, data: memoryview | bytes) -> None:
        if self._skip or not memoryview(data).nbytes:
            return
        assert self._flat is not None
        src = torch.frombuffer(bytearray(data) if isinstance(data, bytes) else data,
                               dtype=torch.uint8).view(self._dtype)
        with torch.no_grad():
            self._flat[self._at: self._at + src.numel()].copy_(src)
        self._at += src.numel()

    def end(self) -> None:
        if self._flat is not None and self._at != self._flat.numel():
            raise MaecError(f"model sink: {self._at} of {self._flat.numel()} elements given")
        self._flat = None

    def close(self) -> list[WrittenFile]:
        return []

    def abort(self) -> None:
        self._flat = None
        self._on_abort()


def _architecture(folder: Path) -> dict[str, Any]:
    """The folder's config less its dtype: equal for checkpoints one model object can
    hold in turn (the weights convert to the model's dtype)."""
    config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    return config


class ModelSlot:
    """Holds at most one model: built from a merge's definition files (``build``, by
    ``sink`` with a skeleton) or loaded from a folder (``load``); a candidate's weights
    go into it from the merge itself (``sink``) or from its folder (``load``), then
    ``score`` evaluates it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.loaded: LoadedModel | None = None
        self._config: dict[str, Any] | None = None
        # Whether the loaded model's checkpoints name its weights as it does: not when
        # transformers converted the names as it loaded (e.g. Mixtral's experts, stored
        # one by one and held fused), and then only a fresh load can read the next one.
        self._by_name = True

    def load(self, folder: Path) -> LoadedModel:
        """Put the checkpoint in ``folder`` in the slot: built from it when the slot is
        empty, holds another architecture, or holds a model whose checkpoints transformers
        converts as it loads; else its tensors copied into the model."""
        config = _architecture(folder)
        folder_info = open_model_folder(folder)
        if self.loaded is None or config != self._config or not self._by_name:
            self.close()
            self.loaded, self._config = load_model(folder, self.device), config
            try:
                check_names(self.loaded.model, set(folder_info.tensors), str(folder))
            except NamesDiffer:
                self._by_name = False
            return self.loaded
        from safetensors.torch import load_file

        model = self.loaded.model
        check_names(model, set(folder_info.tensors), str(folder))
        _state, tied = _targets(model)
        with torch.no_grad():
            for path in folder_info.weight_files:
                tensors = load_file(str(path), device=str(self.device))
                # A tied weight's second name, if stored, is ignored as a fresh load
                # (and the sink) ignore it: the first name's values stand.
                model.load_state_dict({k: v for k, v in tensors.items() if k not in tied},
                                      strict=False)
                del tensors
        return self.loaded

    def sink(self, outputs: list[OutputTensor], skeleton: Path | None = None
             ) -> ModelSink:
        """A sink that puts a merge's tensors into the model in the slot (the engine's
        ``EngineOptions.sink``). With ``skeleton`` (the merge's definition files,
        ``EngineOptions.skeleton``) the model is first built from it, replacing any the
        slot holds; without, the slot must hold a model of the candidates' kind."""
        if skeleton is not None:
            self.build(skeleton, {t.name for t in outputs})
        if self.loaded is None:
            raise MaecError("the model slot is empty: build or load a candidate first")
        return ModelSink(self.loaded.model, outputs, self.close)

    def build(self, skeleton: Path, given: set[str]) -> LoadedModel:
        """Put in the slot the model the definition files in ``skeleton`` describe, its
        weights empty for the tensors ``given`` to fill (checked to fit it before any
        memory is taken)."""
        self.close()
        config = _architecture(skeleton)
        self.loaded = build_model(skeleton, self.device, given,
                                  check=lambda model: check_names(model, given,
                                                                  "the candidate"))
        self._config, self._by_name = config, True
        return self.loaded

    def score(self, label: str, model_dir: str, sets: list[LoadedSet], ctx: RunContext
              ) -> ModelResult:
        """Evaluate the model in the slot on ``sets`` as the row ``label`` (``ctx``'s
        progress and cancel apply)."""
        if self.loaded is None:
            raise MaecError("the model slot is empty: nothing to score")
        t0 = time.perf_counter()
        loaded = self.loaded
        results = [evaluate_set(loaded, s, ctx, stage=label) for s in sets]
        return ModelResult(label=label, model_dir=model_dir, device=str(self.device),
                           dtype=loaded.dtype, seconds=time.perf_counter() - t0,
                           sets=results)

    def close(self) -> None:
        """Drop the model (before the next different one loads, and at the end)."""
        if self.loaded is not None:
            alive = self.loaded.references()
            self.loaded, self._config = None, None
            release(alive, self.device)
