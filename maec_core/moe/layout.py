"""Where each tensor of a Mixtral or Qwen2-MoE output comes from (names and shapes as
mergekit-moe 0.1.5 writes them, which are the names transformers' models load).

Mixtral (and Qwen3-MoE, the same with Qwen3's query and key norms): the base's
attention, norms, embedding and head; per layer one
``mlp.experts.gate_up_proj`` (experts x [gate; up] rows) and one ``mlp.experts.down_proj``
(experts x down), each expert's rows contiguous, so both stream piece by piece; and the
router ``mlp.gate.weight``. Qwen2-MoE: per expert its own ``mlp.experts.<e>.*``, the shared
expert's ``mlp.shared_expert.*``, the routers ``mlp.gate`` and ``mlp.shared_expert_gate``,
and zeros for attention biases a Llama or Mistral base lacks (Qwen2 has them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from maec_core.errors import IncompatibleCheckpoints, UnsupportedDtype
from maec_core.io.folder import ModelFolder
from maec_core.io.headers import FLOAT_DTYPES, TensorInfo
from maec_core.moe.config import Expert, MoeConfig

OutputArch = Literal["mixtral", "qwen2_moe", "qwen3_moe"]
MLP = ("gate_proj", "up_proj", "down_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
SAFETENSORS_OF = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


@dataclass(frozen=True)
class Piece:
    """Bytes of one input tensor, cast to the output dtype; an expert's with its noise
    and (on a down projection) its residual scale applied first."""

    source: TensorInfo
    expert: Expert | None = None
    residual: bool = False


@dataclass(frozen=True)
class MoeTensor:
    """One output tensor: its pieces laid end to end (one piece: a copy), or zeros, or
    router rows (``gate``: the layer, and whether the shared experts' gate)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors name
    pieces: tuple[Piece, ...] = ()
    zeros: bool = False
    gate: tuple[int, bool] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def need(folder: ModelFolder, name: str) -> TensorInfo:
    info = folder.tensors.get(name)
    if info is None:
        raise IncompatibleCheckpoints(f"{folder.root.name} has no tensor {name!r}",
                                      tensor=name, model=folder.root.name)
    if info.dtype not in FLOAT_DTYPES:
        raise UnsupportedDtype(f"{folder.root.name}: {name} is {info.dtype}; only "
                               "F16, BF16 and F32 tensors are read", tensor=name)
    return info




def _base_names(layers: int, biases: bool, qk_norms: bool = False) -> list[str]:
    """The dense (non-MLP) weights the output takes from the base, in order."""
    names = ["model.embed_tokens.weight"]
    for i in range(layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight"]
        if qk_norms:  # Qwen3 normalises queries and keys per head
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        for proj in ATTENTION:
            names.append(f"{p}self_attn.{proj}.weight")
            if biases and proj != "o_proj":
                names.append(f"{p}self_attn.{proj}.bias")
        names += [p + "post_attention_layernorm.weight"]
    return [*names, "model.norm.weight"]


def _copies(base: ModelFolder, names: list[str], st: str, zeros_for_bias: bool) -> list[MoeTensor]:
    out: list[MoeTensor] = []
    heads = int(base.config.get("num_attention_heads") or 0)
    kv_heads = int(base.config.get("num_key_value_heads") or heads)
    hidden = int(base.config["hidden_size"])
    for name in names:
        if zeros_for_bias and name.endswith("_proj.bias") and name not in base.tensors:
            if heads <= 0:
                raise IncompatibleCheckpoints(f"{base.root.name}: config.json has no "
                                              "num_attention_heads", field="num_attention_heads")
            n = kv_heads if name.endswith(("k_proj.bias", "v_proj.bias")) else heads
            out.append(MoeTensor(name, (n * (hidden // heads),), st, zeros=True))
            continue
        info = need(base, name)
        out.append(MoeTensor(name, info.shape, st, (Piece(info),)))
    head = base.tensors.get("lm_head.weight")
    if head is not None:  # optional: a tied model has none
        out.append(MoeTensor(head.name, head.shape, st, (Piece(need(base, head.name)),)))
    return out


def _left_out(base: ModelFolder, kept: set[str]) -> list[str]:
    """Base tensors (other than MLPs) the output architecture has no place for."""
    gone = sorted(n for n in base.tensors if n not in kept and ".mlp." not in n)
    return [f"{n}: not part of the output architecture, left out" for n in gone]


def base_names(arch: OutputArch, layers: int) -> set[str]:
    """Every tensor name ``arch`` takes from the base (the head when the base has one)."""
    qwen2 = arch == "qwen2_moe"
    return {*_base_names(layers, biases=qwen2, qk_norms=arch == "qwen3_moe"),
            "lm_head.weight"}


def layout(arch: OutputArch, config: MoeConfig, folders: dict[str, ModelFolder],
           layers: int, hidden: int, st: str, warnings: list[str]) -> list[MoeTensor]:
    base = folders[config.base_model]
    if arch in ("mixtral", "qwen3_moe"):
        # The same expert layout (fused gate_up and down per layer, one router).
        names = _base_names(layers, biases=False, qk_norms=arch == "qwen3_moe")
        out = _copies(base, names, st, False)
        out += _fused_experts(config, folders, layers, hidden, st)
    else:
        out = _copies(base, _base_names(layers, biases=True), st, True)
        out += _qwen_experts(config, folders, layers, hidden, st)
    warnings += _left_out(base, {t.name for t in out})
    return out


def _fused_experts(config: MoeConfig, folders: dict[str, ModelFolder], layers: int,
                     hidden: int, st: str) -> list[MoeTensor]:
    out: list[MoeTensor] = []
    n = len(config.experts)
    for i in range(layers):
        p = f"model.layers.{i}.mlp."
        gate_up: list[Piece] = []
        down: list[Piece] = []
        for e in config.experts:
            f = folders[e.source_model]
            gate_up += [Piece(need(f, f"{p}gate_proj.weight"), e),
                        Piece(need(f, f"{p}up_proj.weight"), e)]
            down.append(Piece(need(f, f"{p}down_proj.weight"), e, residual=True))
        rows, cols = gate_up[0].source.shape
        out.append(MoeTensor(f"{p}experts.gate_up_proj", (n, 2 * rows, cols), st,
                             tuple(gate_up)))
        out.append(MoeTensor(f"{p}experts.down_proj", (n, *down[0].source.shape), st,
                             tuple(down)))
        out.append(MoeTensor(f"{p}gate.weight", (n, hidden), st, gate=(i, False)))
    return out


def _qwen_experts(config: MoeConfig, folders: dict[str, ModelFolder], layers: int,
                  hidden: int, st: str) -> list[MoeTensor]:
    out: list[MoeTensor] = []
    shared = (config.shared_experts or [])[0]
    for i in range(layers):
        p = f"model.layers.{i}.mlp."
        for slot, e in [*((f"experts.{k}.", e) for k, e in enumerate(config.experts)),
                        ("shared_expert.", shared)]:
            f = folders[e.source_model]
            for proj in MLP:
                info = need(f, f"{p}{proj}.weight")
                out.append(MoeTensor(f"{p}{slot}{proj}.weight", info.shape, st,
                                     (Piece(info, e, residual=proj == "down_proj"),)))
        out.append(MoeTensor(f"{p}gate.weight", (len(config.experts), hidden), st,
                             gate=(i, False)))
        out.append(MoeTensor(f"{p}shared_expert_gate.weight", (1, hidden), st,
                             gate=(i, True)))
    return out
