"""A PEFT LoRA adapter seen as a checkpoint: its base's tensors, targeted ones plus a delta.

An adapter folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` whose
tensors are ``base_model.model.<module>.lora_A.weight`` (r, in) and ``...lora_B.weight``
(out, r). The view maps each pair onto the base tensor ``<module>.weight`` as a
``LowRankDelta`` (scale ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA);
readers add ``scale * B @ A`` tensor by tensor, so no merged copy of the model is ever
written. Torch-free and header-only: the API checks adapters with it before queueing.

Supported: plain LoRA on 2-D weights (``nn.Linear``, and GPT-2's ``Conv1D`` through
``fan_in_fan_out``). Refused with ``unsupported_adapter``: other PEFT types, DoRA,
``modules_to_save`` / ``trainable_token_indices`` (they carry full replacement tensors,
whose dtype and tying would have to be reconciled with the base: merge a full checkpoint
instead), LoRA biases, per-module ranks or alphas, layer replication, LoRA on embeddings
or on raw parameters.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maec_core.errors import CheckpointError, CorruptCheckpoint, UnsupportedAdapter
from maec_core.io.headers import FLOAT_DTYPES, LowRankDelta, SafetensorsHeader, TensorInfo

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# What peft names the wrapped model's modules in a saved adapter.
PEFT_PREFIX = "base_model.model."
LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"
# Config fields that, when set, change the adapter's effect beyond scale * B @ A.
_REFUSED_FIELDS = ("use_dora", "modules_to_save", "trainable_token_indices", "lora_bias",
                   "rank_pattern", "alpha_pattern", "layer_replication", "target_parameters")


@dataclass(frozen=True)
class AdapterSpec:
    """What an adapter config says about forming its deltas."""

    rank: int
    alpha: float
    rslora: bool
    transpose: bool
    base_ref: str | None
    target_modules: Any

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def _number(config: Mapping[str, Any], key: str) -> float:
    v = config.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise CorruptCheckpoint(f"{ADAPTER_CONFIG}: {key} is {v!r}, not a number",
                                file=ADAPTER_CONFIG, field=key)
    return float(v)


def adapter_spec(config: Mapping[str, Any]) -> AdapterSpec:
    """Check an adapter config and read what forming its deltas needs."""
    kind = config.get("peft_type")
    if kind != "LORA":
        raise UnsupportedAdapter(f"{ADAPTER_CONFIG}: peft_type {kind!r} is not supported "
                                 "(only LORA adapters)", field="peft_type")
    for key in _REFUSED_FIELDS:
        if config.get(key):
            raise UnsupportedAdapter(
                f"{ADAPTER_CONFIG}: {key} is set; only plain LoRA adapters (scale x B x A "
                "on 2-D weights) are supported (merge a full checkpoint instead)", field=key)
    if config.get("bias", "none") not in ("none", None):
        raise UnsupportedAdapter(f"{ADAPTER_CONFIG}: bias {config.get('bias')!r} trains base "
                                 "biases; only bias 'none' is supported", field="bias")
    rank = _number(config, "r")
    if rank != int(rank) or rank < 1:
        raise CorruptCheckpoint(f"{ADAPTER_CONFIG}: r is {rank}, not a positive integer",
                                file=ADAPTER_CONFIG, field="r")
    base = config.get("base_model_name_or_path")
    return AdapterSpec(
        rank=int(rank), alpha=_number(config, "lora_alpha"),
        rslora=bool(config.get("use_rslora", False)),
        transpose=bool(config.get("fan_in_fan_out", False)),
        base_ref=base if isinstance(base, str) and base else None,
        target_modules=config.get("target_modules"),
    )


LoraPairs = dict[str, tuple[TensorInfo, TensorInfo]]


def adapter_pairs(header: SafetensorsHeader) -> LoraPairs:
    """``{module: (A, B)}`` from the adapter file's tensor names (refusing any other)."""
    found: dict[str, dict[str, TensorInfo]] = {}
    for name, info in header.tensors.items():
        part = next((p for p in (LORA_A, LORA_B) if name.endswith(p)), None)
        if not name.startswith(PEFT_PREFIX) or part is None:
            raise UnsupportedAdapter(
                f"{ADAPTER_WEIGHTS}: tensor {name!r} is not a LoRA A or B matrix "
                "(full replaced modules, embeddings and biases are not supported)",
                tensor=name)
        if info.dtype not in FLOAT_DTYPES:
            raise CorruptCheckpoint(f"{ADAPTER_WEIGHTS}: tensor {name!r} is {info.dtype}; "
                                    "LoRA matrices must be F16, BF16 or F32", tensor=name)
        module = name[len(PEFT_PREFIX): -len(part)]
        found.setdefault(module, {})[part] = info
    pairs = {}
    for module, parts in found.items():
        if len(parts) != 2:
            raise CorruptCheckpoint(f"{ADAPTER_WEIGHTS}: module {module!r} has only one of "
                                    "lora_A and lora_B", module=module)
        pairs[module] = (parts[LORA_A], parts[LORA_B])
    if not pairs:
        raise CorruptCheckpoint(f"{ADAPTER_WEIGHTS} holds no LoRA matrices")
    return pairs


def _delta(spec: AdapterSpec, module: str, a: TensorInfo, b: TensorInfo,
           base: TensorInfo) -> LowRankDelta:
    """The module's delta, once shapes agree: A (r, in), B (out, r), base (out, in)
    (or (in, out) with fan_in_fan_out)."""
    if len(a.shape) != 2 or len(b.shape) != 2 or len(base.shape) != 2:
        raise UnsupportedAdapter(f"module {module!r}: LoRA is supported on 2-D weights only",
                                 module=module)
    rank, fan_in = a.shape
    fan_out, rank_b = b.shape
    if rank != spec.rank or rank_b != spec.rank:
        raise CorruptCheckpoint(
            f"module {module!r}: lora_A is {list(a.shape)} and lora_B {list(b.shape)}, but "
            f"the adapter's r is {spec.rank}", module=module)
    want = (fan_in, fan_out) if spec.transpose else (fan_out, fan_in)
    if base.shape != want:
        raise CheckpointError(
            f"module {module!r}: the adapter's B x A is {list(want)} but the base tensor "
            f"{base.name!r} is {list(base.shape)} (an adapter for another base?)",
            module=module, adapter_shape=list(want), base_shape=list(base.shape))
    return LowRankDelta(a=a, b=b, scale=spec.scale, transpose=spec.transpose)


def adapter_tensors(spec: AdapterSpec, pairs: LoraPairs,
                    base: Mapping[str, TensorInfo]) -> dict[str, TensorInfo]:
    """The base's tensors, each targeted one carrying its low-rank delta (header-only)."""
    tensors = dict(base)
    for module, (a, b) in pairs.items():
        name = f"{module}.weight"
        info = base.get(name)
        if info is None:
            raise CheckpointError(
                f"the adapter targets {module!r}, but the base has no tensor {name!r} "
                "(an adapter for another base, or a tied weight)", module=module, tensor=name)
        tensors[name] = dataclasses.replace(info, delta=_delta(spec, module, a, b, info))
    return tensors


def base_path(spec: AdapterSpec, root: Path, *, allowed: bool) -> Path:
    """The base named in the adapter config, when it is a local checkpoint folder and
    the caller ``allowed`` following it."""
    if not allowed:
        raise CheckpointError(
            f"{root.name} is a LoRA adapter; name its base in the recipe (base_model): a "
            "base named only inside the adapter is not followed here", path=str(root))
    if spec.base_ref is None:
        raise CheckpointError(
            f"{root.name}: the adapter names no base_model_name_or_path; name its base "
            "in the recipe (base_model)", path=str(root))
    path = Path(spec.base_ref)
    if not path.is_dir():
        raise CheckpointError(
            f"{root.name}: the adapter's base {spec.base_ref!r} is not a local checkpoint "
            "folder; name its base in the recipe (base_model)",
            path=str(root), base=spec.base_ref)
    return path
