"""The plan: decide, from configs and headers alone, which tensors a merge reads and writes.

Runs before any tensor data is touched (and in the API process, which has no torch), so
a vocab mismatch or a quantized donor fails in milliseconds instead of after a download
and a 20-minute merge.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from maec_core.errors import IncompatibleCheckpoints, UnsupportedDtype
from maec_core.io.folder import ModelFolder
from maec_core.io.headers import FLOAT_DTYPES, TensorInfo

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
# Config fields whose disagreement means "not the same architecture", reported by name
# before any per-tensor comparison so the message says what the user got wrong.
ARCH_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)
DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclass(frozen=True)
class PlannedTensor:
    """One output tensor and where every input holds it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    sources: dict[str, TensorInfo]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class MergePlan:
    models: dict[str, ModelFolder]
    reference: str
    tensors: list[PlannedTensor]

    @property
    def input_dtype(self) -> str:
        """The reference model's weight dtype as a torch name (the default output dtype)."""
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel
        return DTYPE_NAMES[max(counts, key=lambda k: counts[k])]

    @property
    def num_layers(self) -> int:
        cfg = self.models[self.reference].config
        n = cfg.get("num_hidden_layers") or (cfg.get("text_config") or {}).get(
            "num_hidden_layers"
        )
        return int(n or 0)


def _lookup(folder: ModelFolder, name: str) -> TensorInfo | None:
    info = folder.tensors.get(name)
    if info is None and name == LM_HEAD and folder.tie_word_embeddings:
        # Tied checkpoints (Llama-3.2, Gemma) store only the embedding; lm_head is it.
        info = folder.tensors.get(EMBED)
    return info


def check_configs(models: Mapping[str, ModelFolder]) -> None:
    """Compare architecture fields across configs and name the first disagreement."""
    for fld in ARCH_FIELDS:
        values = {key: m.config.get(fld) for key, m in models.items()}
        present = {k: v for k, v in values.items() if v is not None}
        if len(set(map(repr, present.values()))) > 1:
            what = "vocab size" if fld == "vocab_size" else fld
            listing = ", ".join(f"{k}={v}" for k, v in present.items())
            raise IncompatibleCheckpoints(
                f"{what} differs between checkpoints: {listing}", field=fld, values=present
            )


def build_plan(models: Mapping[str, ModelFolder], reference: str) -> MergePlan:
    """Check that all ``models`` share tensor names, shapes and dtypes; return the plan.

    ``reference`` names the model whose tensor set and file layout the output follows.
    """
    check_configs(models)
    ref = models[reference]
    ordered = sorted(
        ref.tensors.values(),
        key=lambda t: (ref.weight_files.index(t.file), t.start),
    )
    planned: list[PlannedTensor] = []
    for info in ordered:
        if info.dtype not in FLOAT_DTYPES:
            raise UnsupportedDtype(
                f"{reference}: tensor {info.name!r} is {info.dtype}; only F16, BF16 and F32 "
                "safetensors can be merged (quantized checkpoints are not supported)",
                tensor=info.name,
                model=reference,
                dtype=info.dtype,
            )
        sources = {}
        for key, folder in models.items():
            other = _lookup(folder, info.name)
            if other is None:
                raise IncompatibleCheckpoints(
                    f"tensor {info.name!r} is in {reference} but missing from {key}",
                    tensor=info.name,
                    models=[reference, key],
                )
            if other.dtype not in FLOAT_DTYPES:
                # Checked per input, not only on the reference: a quantized donor must be
                # named as such, not reported as a dtype mismatch.
                raise UnsupportedDtype(
                    f"{key}: tensor {info.name!r} is {other.dtype}; only F16, BF16 and F32 "
                    "safetensors can be merged (quantized checkpoints are not supported)",
                    tensor=info.name,
                    model=key,
                    dtype=other.dtype,
                )
            if other.shape != info.shape:
                raise IncompatibleCheckpoints(
                    f"tensor {info.name!r} has shape {list(info.shape)} in {reference} "
                    f"but {list(other.shape)} in {key}",
                    tensor=info.name,
                    shapes={reference: list(info.shape), key: list(other.shape)},
                )
            if other.dtype != info.dtype:
                raise IncompatibleCheckpoints(
                    f"tensor {info.name!r} is {info.dtype} in {reference} "
                    f"but {other.dtype} in {key}",
                    tensor=info.name,
                    dtypes={reference: info.dtype, key: other.dtype},
                )
            sources[key] = other
        planned.append(PlannedTensor(info.name, info.shape, info.dtype, sources))
    ref_names = {t.name for t in planned}
    for key, folder in models.items():
        for name in folder.tensors:
            tied_extra = name == LM_HEAD and ref.tie_word_embeddings
            if name not in ref_names and not tied_extra:
                raise IncompatibleCheckpoints(
                    f"tensor {name!r} is in {key} but missing from {reference}",
                    tensor=name,
                    models=[key, reference],
                )
    return MergePlan(dict(models), reference, planned)
