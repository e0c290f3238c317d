"""``mergekit-moe`` configs: a base model, dense experts and how tokens are routed to them.

Torch-free, so the API checks a config before anything is queued. The shape and rules
are mergekit-moe 0.1.5's (``base_model``, ``experts`` with ``source_model`` and prompts,
``gate_mode``, ``dtype``, ``experts_per_token``, ``shared_experts``, ``architecture``);
every refusal is a :class:`~maec_core.errors.RecipeError` that names the field. Keys
mergekit-moe does not read are ignored by it; here they are accepted and reported as
warnings, never dropped silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from maec_core.errors import RecipeError
from maec_core.recipe import read_yaml

# mergekit-moe's gate modes. ``hidden`` and ``hidden_last`` route by the base model's
# hidden state at each prompt's last token, ``hidden_avg`` by its mean over the prompt,
# ``cheap_embed`` by the prompts' mean token embedding (the same for every layer);
# ``random`` draws N(0, 1) router rows, ``uniform_random`` torch.nn.Linear's init.
GateMode = Literal["hidden", "hidden_avg", "hidden_last", "cheap_embed", "random",
                   "uniform_random"]
RANDOM_MODES = ("random", "uniform_random")
# The method name of an MoE job (records, the API's job list, the worker's dispatch).
MOE_METHOD = "moe"
# Output dtype names as mergekit reads them (its dtype_from_name).
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float16": "float16",
               "fp16": "float16", "half": "float16", "bfloat16": "bfloat16",
               "bf16": "bfloat16"}
# Caps for what a config may hold: a service reads them from untrusted bodies.
MAX_EXPERTS = 64
MAX_PROMPTS = 256
MAX_PROMPT_CHARS = 4096


def _plain_model(v: str) -> str:
    if "+" in v:
        # mergekit reads ``model+adapter`` as a model with a LoRA applied.
        raise ValueError("a model with a LoRA adapter ('model+adapter') is not accepted "
                         "as an MoE expert or base: merge the adapter first")
    return v


class Expert(BaseModel):
    """One dense model whose MLPs become one expert in every layer."""

    # Keys mergekit does not read are kept to be reported (MoeConfig.ignored).
    model_config = ConfigDict(extra="allow")

    source_model: str = Field(min_length=1, max_length=2048)
    positive_prompts: list[str] | None = Field(default=None, max_length=MAX_PROMPTS)
    negative_prompts: list[str] | None = Field(default=None, max_length=MAX_PROMPTS)
    # Gaussian noise of this scale added to the expert's MLP weights (unseeded in
    # mergekit; seeded here by ``random_seed``).
    noise_scale: float | None = Field(default=None, ge=0, le=1e3, allow_inf_nan=False)
    # The expert's down projection multiplied by this.
    residual_scale: float | None = Field(default=None, ge=-1e3, le=1e3, allow_inf_nan=False)

    @field_validator("source_model")
    @classmethod
    def _plain(cls, v: str) -> str:
        return _plain_model(v)

    @field_validator("positive_prompts", "negative_prompts")
    @classmethod
    def _short(cls, v: list[str] | None) -> list[str] | None:
        for p in v or []:
            if len(p) > MAX_PROMPT_CHARS:
                raise ValueError(f"a prompt is {len(p)} characters, above the "
                                 f"{MAX_PROMPT_CHARS} cap")
        return v


class MoeConfig(BaseModel):
    """A mergekit-moe config (its YAML shape)."""

    model_config = ConfigDict(extra="allow")

    base_model: str = Field(min_length=1, max_length=2048)
    experts: list[Expert] = Field(min_length=1, max_length=MAX_EXPERTS)
    gate_mode: GateMode = "hidden"
    dtype: str | None = None
    experts_per_token: int = Field(default=2, ge=1, le=MAX_EXPERTS)
    shared_experts: list[Expert] | None = Field(default=None, max_length=MAX_EXPERTS)
    architecture: str | None = Field(default=None, max_length=64)
    # Ours: seeds the random gate modes and experts' noise (mergekit's are unseeded).
    random_seed: int = Field(default=0, ge=0, lt=2**63)
    name: str | None = Field(default=None, max_length=200)
    # Ours: accept experts that are all one model (mergekit-moe's
    # --i-understand-this-is-not-useful-without-training).
    allow_all_same: bool = False
    out_shard_size: int | str = "5GB"

    @field_validator("base_model")
    @classmethod
    def _plain_base(cls, v: str) -> str:
        return _plain_model(v)

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str | None) -> str | None:
        if v is None:
            return None
        if v not in DTYPE_NAMES:
            raise ValueError(f"dtype {v!r} is not one of {sorted(set(DTYPE_NAMES.values()))}")
        return DTYPE_NAMES[v]

    @property
    def merge_method(self) -> str:
        """The method a job record names for an MoE build."""
        return MOE_METHOD

    @property
    def ignored(self) -> list[str]:
        """Keys given that mergekit-moe does not read (accepted, reported)."""
        out = sorted(self.model_extra or {})
        for group, experts in (("experts", self.experts),
                               ("shared_experts", self.shared_experts or [])):
            for i, e in enumerate(experts):
                out += [f"{group}[{i}].{k}" for k in sorted(e.model_extra or {})]
        return out

    @property
    def warnings(self) -> list[str]:
        """The ignored keys as the build reports them, one line each."""
        return [f"{key}: not read by mergekit-moe, ignored" for key in self.ignored]

    def all_experts(self) -> list[Expert]:
        return [*self.experts, *(self.shared_experts or [])]

    def sources(self) -> list[str]:
        """Every checkpoint the config reads, base first, no repeats."""
        return list(dict.fromkeys([self.base_model,
                                   *(e.source_model for e in self.all_experts())]))

    def with_sources(self, mapping: Mapping[str, str]) -> MoeConfig:
        """A copy with every model reference found in ``mapping`` replaced."""

        def sub(e: Expert) -> Expert:
            return e.model_copy(update={"source_model": mapping.get(e.source_model,
                                                                    e.source_model)})

        return self.model_copy(update={
            "base_model": mapping.get(self.base_model, self.base_model),
            "experts": [sub(e) for e in self.experts],
            "shared_experts": ([sub(e) for e in self.shared_experts]
                               if self.shared_experts is not None else None),
        })

    def shard_size_bytes(self) -> int:
        from maec_core.recipe import parse_size

        return parse_size(self.out_shard_size)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", exclude_none=True),
                              sort_keys=False)


def check_config(config: MoeConfig) -> None:
    """mergekit-moe's own refusals of a config (before any model is read)."""
    if len(config.experts) < config.experts_per_token:
        raise RecipeError(
            f"experts_per_token is {config.experts_per_token} but the config has "
            f"{len(config.experts)} experts: give at least as many experts",
            key="experts_per_token")
    if config.gate_mode == "random":
        return  # mergekit asks nothing more of a random gate (uniform_random: prompts)
    for i, expert in enumerate(config.experts):
        if not expert.positive_prompts:
            raise RecipeError(f"experts[{i}] has no positive_prompts (gate_mode "
                              f"{config.gate_mode} routes by them)",
                              key=f"experts[{i}].positive_prompts")

    def prompts(e: Expert) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return tuple(e.positive_prompts or []), tuple(e.negative_prompts or [])

    first = prompts(config.experts[0])
    if all(prompts(e) == first for e in config.experts[1:]):
        raise RecipeError("every expert has the same positive and negative prompts: the "
                          "router could not tell them apart", key="experts")
    same = all(e.source_model == config.experts[0].source_model for e in config.experts[1:])
    if same and not config.allow_all_same:
        raise RecipeError(
            "every expert is the same model: the result computes what that model does, at "
            "more cost (allow it only to train the MoE further: allow_all_same)",
            key="experts")


def parse_moe_config(source: MoeConfig | Mapping[str, Any] | str | Path, *,
                     allow_all_same: bool = False) -> MoeConfig:
    """Load and check a mergekit-moe config from a model, mapping, YAML path or text."""
    config = source if isinstance(source, MoeConfig) else _validate(read_yaml(source, "MoE config"))
    if allow_all_same:
        config = config.model_copy(update={"allow_all_same": True})
    check_config(config)
    config.shard_size_bytes()
    return config


def _validate(data: Any) -> MoeConfig:
    if not isinstance(data, dict):
        raise RecipeError("an MoE config must be a YAML mapping")
    try:
        return MoeConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = "unknown key"
        raise RecipeError(f"MoE config: {where}: {msg}" if where else f"MoE config: {msg}",
                          key=where, problems=len(exc.errors())) from None
