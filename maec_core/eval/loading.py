"""The model an evaluation scores: loaded from a checkpoint folder, or built from a
folder's definition files alone for weights that arrive another way.

Loading (:func:`load_model`) opens the folder with the same checks as a merge input
(safetensors only, no pickles, shard names inside the folder), then loads it with
transformers from the folder alone: never a hub, never remote code. Building
(:func:`build_model`) reads only the config, generation config and tokenizer files and
leaves every weight for the caller to fill (a sweep streams a merge into it). Both
take their dtype, device and mode from one place (:func:`eval_dtype`, :func:`_ready`),
so a model built and filled holds what a load of the same checkpoint gives.
"""

from __future__ import annotations

import gc
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from maec_core.errors import CheckpointError
from maec_core.io.folder import open_model_folder

GENERATION_CONFIG = "generation_config.json"


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    device: torch.device

    @property
    def dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    @property
    def max_positions(self) -> int | None:
        cfg = self.model.config
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            value = getattr(cfg, key, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    def references(self) -> list[weakref.ref[Any]]:
        """Weak references to the model and its parameters, to tell whether dropping
        the last strong reference freed them (:func:`release`)."""
        return [weakref.ref(self.model), *(weakref.ref(p) for p in self.model.parameters())]


def release(alive: list[weakref.ref[Any]], device: torch.device) -> None:
    """Free a model whose last strong reference the caller just dropped.

    Dropping the last reference frees the weights at once; a full collection (a fifth
    of a second in a process that imported transformers, paid per model evaluated) is
    only needed when a reference cycle still holds them."""
    if any(ref() is not None for ref in alive):
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def eval_dtype(device: torch.device) -> torch.dtype | str:
    """The dtype a model is scored in on ``device``: float32 on a CPU (bf16 CPU matmuls
    are slow and inexact), the stored dtype (transformers' ``"auto"``) on an
    accelerator."""
    return torch.float32 if device.type == "cpu" else "auto"


def _tokenizer(root: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(root, local_files_only=True,
                                             trust_remote_code=False)
    except Exception as exc:  # transformers raises many types for a missing tokenizer
        raise CheckpointError(f"{root} has no usable tokenizer: {exc}", path=root) from None


def _ready(model: Any, tokenizer: Any, device: torch.device) -> LoadedModel:
    """The model on ``device``, in evaluation mode (no dropout), with its tokenizer."""
    model.to(device)
    return LoadedModel(model.eval(), tokenizer, device)


def load_model(model_dir: str | Path, device: torch.device) -> LoadedModel:
    """The folder's tokenizer and causal LM on ``device``, in :func:`eval_dtype`."""
    from transformers import AutoModelForCausalLM

    folder = open_model_folder(model_dir)
    root = str(folder.root)
    tokenizer = _tokenizer(root)
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(
            root, local_files_only=True, trust_remote_code=False, dtype=eval_dtype(device),
            use_safetensors=True,
        )
    except Exception as exc:
        raise CheckpointError(f"cannot load {root} for evaluation: {exc}", path=root) from None
    return _ready(model, tokenizer, device)


def build_model(folder: Path, device: torch.device, given: set[str],
                check: Callable[[Any], None] | None = None) -> LoadedModel:
    """The causal LM the definition files in ``folder`` describe (config.json,
    generation_config.json, tokenizer files; no weights), with its tokenizer, on
    ``device`` in :func:`eval_dtype`, its stored tensors ``given`` left for the caller
    to fill: a checkpoint of these files and those tensors then loads as this model.

    The model is built on the meta device (no random initialisation to pay for a model
    whose every weight is about to be replaced), then given memory on ``device``; what
    a load computes rather than reads (tensors not in ``given``, such as the rotary
    ``inv_freq`` buffers) is computed by transformers' own initialisation, as a load
    computes it. ``check(model)`` runs on the meta model, before any memory is
    allocated: a refusal costs nothing.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    root = str(folder)
    tokenizer = _tokenizer(root)
    try:
        config = AutoConfig.from_pretrained(root, local_files_only=True,
                                            trust_remote_code=False)
        dtype = _dtype_of(config, device)
        with torch.device("meta"):
            model: Any = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                config, dtype=dtype, trust_remote_code=False)
    except Exception as exc:
        raise CheckpointError(f"cannot build a model from {root}: {exc}", path=root) from None
    if check is not None:
        check(model)
    _keep_float32(model, dtype)
    model.to_empty(device=device)
    # to_empty gives each parameter new storage, so tied ones (an output head sharing
    # the embeddings) are separate again until re-tied.
    model.tie_weights()
    _compute_unread(model, given)
    if model.can_generate():
        model.generation_config = _generation_config(folder)
    return _ready(model, tokenizer, device)


def _dtype_of(config: Any, device: torch.device) -> torch.dtype:
    """:func:`eval_dtype` as a torch dtype: ``"auto"`` is the config's dtype, as a
    load resolves it (the definition files of a merge always state it)."""
    dtype = eval_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    stored = getattr(config, "dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    if not isinstance(stored, torch.dtype):
        raise CheckpointError("the model's config.json states no dtype")
    return stored


def _keep_float32(model: Any, dtype: torch.dtype) -> None:
    """Give the parameters a half-precision load keeps in float32 (the architecture's
    keep-in-fp32 list) float32 on the meta model, as the loader does when it reads
    them: the same names matched the same way (transformers' own dtype plan)."""
    plan = model._get_dtype_plan(dtype)
    if not plan:
        return
    from transformers.core_model_loading import build_glob_alternation

    pattern, group_of, _ = build_glob_alternation(list(plan))
    for name, param in list(model.named_parameters()):
        found = pattern.search(name)
        if found is None or found.lastgroup is None:
            continue
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        target = plan[group_of[found.lastgroup]]
        module._parameters[leaf] = torch.nn.Parameter(param.to(target),
                                                      requires_grad=param.requires_grad)


def _compute_unread(model: Any, given: set[str]) -> None:
    """Compute every tensor a load would not read from the checkpoint (non-persistent
    buffers such as rotary ``inv_freq``, a persistent one the checkpoint lacks), as a
    load computes them after reading the weights: transformers' initialisation, run
    over the model with the tensors the caller fills marked as loaded, so it leaves
    them alone."""
    named = itertools.chain(model.named_parameters(), model.named_buffers())
    for name, tensor in named:
        if name in given:
            tensor._is_hf_initialized = True
    model.initialize_weights()


def _generation_config(folder: Path) -> Any:
    """The generation config a load of a checkpoint with ``folder``'s files gets: its
    generation_config.json, else one made from its config.json."""
    from transformers import GenerationConfig

    root = str(folder)
    if (folder / GENERATION_CONFIG).is_file():
        return GenerationConfig.from_pretrained(root, local_files_only=True)
    # A load without the file reads config.json's generation fields the same way.
    return GenerationConfig.from_pretrained(root, config_file_name="config.json",
                                            _from_model_config=True, local_files_only=True)
