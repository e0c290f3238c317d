"""The MoE's output, planned from headers and configs alone (no tensor data, no torch).

Which output architecture a config gets, and every output tensor with where its bytes
come from: a base tensor copied, experts' MLP tensors laid side by side, zeros, or a
router row computed from the gate mode. The API plans a job before queueing it (every
refusal here is one the worker would meet later); the builder then streams the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from maec_core.accounting import INV_FREQ, Accounting, Uses, account, stored_names
from maec_core.errors import IncompatibleCheckpoints, RecipeError, UnsupportedMoe
from maec_core.io.folder import ModelFolder
from maec_core.moe.config import MoeConfig
from maec_core.moe.layout import (
    MLP,
    SAFETENSORS_OF,
    MoeTensor,
    OutputArch,
    base_names,
    layout,
    need,
)

# mergekit-moe 0.1.5's output architectures, in its order of preference, with the input
# model types each takes. DeepSeek MoE is recognised (so a config that would get it is
# refused by name), not built: its output loads only with DeepSeek's remote code.
ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "Mixtral": ("llama", "mistral"),
    "DeepSeek MoE": ("llama", "mistral"),
    "Qwen MoE": ("llama", "mistral", "qwen2"),
    "Qwen3 MoE": ("qwen3",),
}
BUILT: dict[str, OutputArch] = {"Mixtral": "mixtral", "Qwen MoE": "qwen2_moe",
                                "Qwen3 MoE": "qwen3_moe"}


@dataclass
class MoePlan:
    arch: OutputArch
    out_dtype: str  # float32, float16 or bfloat16
    num_layers: int
    hidden_size: int
    tensors: list[MoeTensor]
    warnings: list[str] = field(default_factory=list)


def _model_type(folder: ModelFolder) -> str:
    return str(folder.config.get("model_type", ""))


def _supports(name: str, config: MoeConfig, types: set[str]) -> str | None:
    """Why mergekit-moe's output architecture ``name`` does not take ``config`` (None:
    it does)."""
    shared = config.shared_experts or []
    if name in ("Mixtral", "Qwen3 MoE") and shared:
        return f"{name} has no shared experts"
    if name == "DeepSeek MoE" and (len(shared) > 1 or any(
            e.positive_prompts or e.negative_prompts for e in shared)):
        return "DeepSeek MoE takes at most one shared expert, without prompts"
    if name == "Qwen MoE":
        if len(shared) != 1:
            return "Qwen MoE needs exactly one shared expert"
        if config.gate_mode != "random" and not shared[0].positive_prompts:
            return "Qwen MoE needs positive_prompts on its shared expert"
    if len(types) != 1:
        return f"{name} needs every input model of one architecture (got {sorted(types)})"
    if not types <= set(ARCHITECTURES[name]):
        return f"{name} takes {', '.join(ARCHITECTURES[name])} models (got {sorted(types)})"
    return None


def choose_architecture(config: MoeConfig, folders: dict[str, ModelFolder]) -> OutputArch:
    """The output architecture mergekit-moe would pick: among those ``architecture``
    names (a prefix, any case) and that take the config, Mixtral if it is one, else the
    first. UnsupportedMoe when that one is not built here, RecipeError when none fits."""
    names = [n for n in ARCHITECTURES
             if config.architecture is None or n.lower().startswith(config.architecture.lower())]
    if not names:
        raise RecipeError(f"architecture {config.architecture!r} names no output "
                          f"architecture (known: {', '.join(ARCHITECTURES)})",
                          key="architecture")
    types = {_model_type(folders[ref]) for ref in config.sources()}
    why = {n: _supports(n, config, types) for n in names}
    fits = [n for n in names if why[n] is None]
    if not fits:
        raise RecipeError("no output architecture takes this config: "
                          + "; ".join(str(w) for w in why.values()), key="architecture")
    pick = "Mixtral" if "Mixtral" in fits else fits[0]
    if pick not in BUILT:
        raise UnsupportedMoe(
            f"this config makes a {pick} model, which is not built here: it loads only "
            "with its publisher's remote code, which this service never runs (built: "
            f"{', '.join(BUILT)}); see docs/moe.md", architecture=pick)
    return BUILT[pick]


def _text_int(cfg: dict[str, Any], key: str, folder: ModelFolder) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise IncompatibleCheckpoints(f"{folder.root.name}: config.json has no {key}",
                                      field=key)
    return value


def output_dtype(config: MoeConfig, base: ModelFolder) -> str:
    """The config's dtype, else the base config's, else its embedding's (mergekit: the
    config's, else the base's torch_dtype)."""
    if config.dtype:
        return config.dtype
    for key in ("dtype", "torch_dtype"):
        value = base.config.get(key)
        if value in SAFETENSORS_OF:
            return str(value)
    embed = base.tensors.get("model.embed_tokens.weight")
    names = {v: k for k, v in SAFETENSORS_OF.items()}
    return names.get(embed.dtype if embed else "F32", "float32")


def _check_experts(config: MoeConfig, folders: dict[str, ModelFolder], layers: int,
                   hidden: int) -> None:
    base = folders[config.base_model]
    for e in config.all_experts():
        f = folders[e.source_model]
        if _text_int(f.config, "num_hidden_layers", f) != layers or _text_int(
                f.config, "hidden_size", f) != hidden:
            raise IncompatibleCheckpoints(
                f"{f.root.name} has {f.config.get('num_hidden_layers')} layers of width "
                f"{f.config.get('hidden_size')}; the base {base.root.name} has {layers} of "
                f"width {hidden}", model=e.source_model)
        for i in range(layers):
            for proj in MLP:
                name = f"model.layers.{i}.mlp.{proj}.weight"
                want = need(base, name).shape
                if need(f, name).shape != want:
                    raise IncompatibleCheckpoints(
                        f"{f.root.name}: {name} is {list(f.tensors[name].shape)}, the "
                        f"base's is {list(want)}", tensor=name, model=e.source_model)


def plan_moe(config: MoeConfig, folders: dict[str, ModelFolder]) -> MoePlan:
    """The whole output, from ``folders`` (every source of ``config``, opened)."""
    base = folders[config.base_model]
    arch = choose_architecture(config, folders)
    layers = _text_int(base.config, "num_hidden_layers", base)
    hidden = _text_int(base.config, "hidden_size", base)
    _check_experts(config, folders, layers, hidden)
    dtype = output_dtype(config, base)
    st = SAFETENSORS_OF[dtype]
    plan = MoePlan(arch, dtype, layers, hidden, [])
    plan.tensors = layout(arch, config, folders, layers, hidden, st, plan.warnings)
    if len(config.experts) & (len(config.experts) - 1):
        plan.warnings.append(f"{len(config.experts)} experts is not a power of two: "
                             "llama.cpp cannot load the model")
    plan.warnings += config.warnings
    return plan


def moe_accounting(config: MoeConfig, folders: dict[str, ModelFolder], plan: MoePlan
                   ) -> Accounting:
    """Where every stored tensor of every source goes in the MoE ``plan``: each output
    tensor's pieces (the base's copies, the experts' MLP matrices laid side by side) or
    left out: rotary ``inv_freq`` buffers, the dense MLPs of a model that is no expert's
    source, an expert model's tensors other than its MLPs, and the base's tensors the
    output architecture has no place for. TensorUnaccounted for anything else."""
    base = config.base_model
    experts = {e.source_model for e in config.all_experts()}
    # The base tensors the architecture has a place for: any of them not read is a drop.
    placed = base_names(plan.arch, plan.num_layers)

    def made_of(t: MoeTensor) -> Uses:
        return t.name, [(p.expert.source_model if p.expert is not None else base, p.source)
                        for p in t.pieces]

    outputs = [made_of(t) for t in plan.tensors]
    used = {(key, info.name) for _, pieces in outputs for key, info in pieces}
    left_out: dict[str, dict[str, str]] = {}
    for ref, folder in folders.items():
        for name in sorted(stored_names(folder)):
            if (ref, name) in used:
                continue
            mlp = ".mlp." in name
            if name.endswith("rotary_emb.inv_freq"):
                reason = INV_FREQ
            elif mlp and ref not in experts:
                reason = "a dense MLP tensor: the MoE layers take the experts' MLPs instead"
            elif mlp:
                continue  # an expert's MLP tensor the layout does not take: unaccounted
            elif ref == base and name in placed:
                continue  # the output has a place for it, yet reads it nowhere
            elif ref == base:
                reason = f"not part of the {plan.arch} output architecture"
            else:
                reason = "an expert's model gives only its MLP tensors (the rest is the base's)"
            left_out.setdefault(ref, {})[name] = reason
    return account(folders, outputs, left_out)
