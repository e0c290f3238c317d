"""MoE conformance with ``mergekit-moe`` 0.1.5: the same config through both tools.

Tiny Llama, Mistral and Qwen2 checkpoints (a base and fine-tunes of it, each with a
local tokenizer) are built here; every config below runs through mergekit-moe's own
build function (in-process, CPU) and through ``maec_core.moe``. Both must accept or
both refuse; where both accept, the outputs must hold the same tensor names, dtypes and
shapes and, for the deterministic gate modes, the same bits, and the same config.json.
The random gate modes (mergekit's draws are unseeded) are compared by statistics: every
other tensor bit for bit, the router rows by their distribution.

:func:`moe_conformance` runs them all and answers the counts for the conformance
RESULT line (``moe_configs=N moe_equal=N``); ``tests/core/test_moe.py`` runs each case.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from tests.factories import TINY, make_llama, tiny_tokenizer

# Keys of config.json that name the writer, not the model.
VOLATILE_CONFIG_KEYS = ("transformers_version",)
A = ["w3 w4 w5 w6", "w7 w8 w9"]
B = ["w20 w21 w22", "w30 w31 w32 w33"]
C = ["w40 w41", "w50 w51 w52"]


def _finetune(cls: Any, cfg: Any, path: Path, seed: int, like: Path | None,
              dtype: torch.dtype) -> Path:
    torch.manual_seed(seed)
    model = cls(cfg)
    if like is not None:
        parent = cls.from_pretrained(like, dtype=torch.float32)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p, q in zip(model.parameters(), parent.parameters(), strict=True):
                p.copy_(q + 0.02 * torch.randn(q.shape, generator=gen))
    model.to(dtype).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def make_family(root: Path, kind: str, dtype: torch.dtype = torch.float32) -> dict[str, Path]:
    """A base and three fine-tunes of it (``a``, ``b``, ``c``) of one architecture."""
    if kind == "llama":
        base = make_llama(root / "base", seed=0, dtype=dtype)
        return {"base": base, **{k: make_llama(root / k, seed=i, like=base, dtype=dtype)
                                 for i, k in enumerate("abc", start=1)}}
    import transformers

    cls, conf = {"mistral": (transformers.MistralForCausalLM, transformers.MistralConfig),
                 "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
                 "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config)}[kind]
    cfg = conf(**TINY, tie_word_embeddings=False)
    base = _finetune(cls, cfg, root / "base", 0, None, dtype)
    return {"base": base, **{k: _finetune(cls, cfg, root / k, i, base, dtype)
                             for i, k in enumerate("abc", start=1)}}


def _expert(model: str, pos: list[str] | None, neg: list[str] | None = None,
            **extra: Any) -> dict[str, Any]:
    e: dict[str, Any] = {"source_model": model}
    if pos is not None:
        e["positive_prompts"] = pos
    if neg is not None:
        e["negative_prompts"] = neg
    return {**e, **extra}


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    config: Callable[[dict[str, Path]], dict[str, Any]]
    # "equal": bit for bit; "random": router rows by statistics; "refused": both refuse.
    expect: str = "equal"
    dtype: torch.dtype = torch.float32


def _two(m: dict[str, Path], mode: str, **top: Any) -> dict[str, Any]:
    return {"base_model": str(m["base"]), "gate_mode": mode,
            "experts": [_expert(str(m["a"]), A), _expert(str(m["b"]), B)], **top}


CASES = [
    Case("mixtral-hidden-llama", "llama", lambda m: _two(m, "hidden")),
    Case("mixtral-hidden-llama-bf16", "llama", lambda m: _two(m, "hidden", dtype="bfloat16")),
    Case("mixtral-hidden_avg-mistral", "mistral", lambda m: _two(m, "hidden_avg")),
    Case("mixtral-cheap_embed-llama-negative", "llama", lambda m: {
        "base_model": str(m["base"]), "gate_mode": "cheap_embed", "experts_per_token": 1,
        "experts": [_expert(str(m["a"]), A, B), _expert(str(m["b"]), B, C),
                    _expert(str(m["c"]), C, residual_scale=0.5)]}),
    Case("mixtral-cheap_embed-bf16-input", "llama", lambda m: _two(m, "cheap_embed"),
         dtype=torch.bfloat16),
    Case("qwen-hidden-qwen2-shared", "qwen2", lambda m: {
        **_two(m, "hidden"), "shared_experts": [_expert(str(m["base"]), C)]}),
    Case("qwen-cheap_embed-llama-shared", "llama", lambda m: {
        **_two(m, "cheap_embed", dtype="float16"), "architecture": "qwen",
        "shared_experts": [_expert(str(m["a"]), C, A, residual_scale=2.0)]}),
    Case("qwen3-hidden-qwen3", "qwen3", lambda m: _two(m, "hidden", dtype="bfloat16")),
    Case("qwen3-cheap_embed-qwen3", "qwen3", lambda m: {
        **_two(m, "cheap_embed"), "experts": [_expert(str(m["a"]), A, C),
                                              _expert(str(m["b"]), B, residual_scale=0.5)]}),
    Case("mixtral-random-llama", "llama", lambda m: {
        **_two(m, "random"), "experts": [_expert(str(m["a"]), None),
                                         _expert(str(m["b"]), None)]}, "random"),
    Case("qwen-random-qwen2-shared", "qwen2", lambda m: {
        **_two(m, "random"), "shared_experts": [_expert(str(m["base"]), None)]}, "random"),
    Case("refused-same-prompts", "llama", lambda m: {
        **_two(m, "hidden"), "experts": [_expert(str(m["a"]), A), _expert(str(m["b"]), A)]},
         "refused"),
    Case("refused-too-few-experts", "llama", lambda m: _two(m, "hidden", experts_per_token=3),
         "refused"),
    Case("refused-qwen2-without-shared", "qwen2", lambda m: _two(m, "hidden"), "refused"),
    Case("refused-qwen3-shared", "qwen3", lambda m: {
        **_two(m, "hidden"), "shared_experts": [_expert(str(m["base"]), C)]}, "refused"),
    Case("refused-no-prompts", "llama", lambda m: {
        **_two(m, "cheap_embed"), "experts": [_expert(str(m["a"]), A),
                                              _expert(str(m["b"]), None)]}, "refused"),
]


def run_mergekit(config: dict[str, Any], out: Path) -> bool:
    """mergekit-moe's build on ``config`` (CPU); False when it refuses the config."""
    from mergekit.moe.config import MoEMergeConfig
    from mergekit.options import MergeOptions
    from mergekit.scripts.moe import build

    try:
        build(MoEMergeConfig.model_validate(config), str(out),
              MergeOptions(device="cpu", copy_tokenizer=True))
    except SystemExit:  # its refusals log and exit
        return False
    return True


def run_ours(config: dict[str, Any], out: Path) -> bool:
    """``maec_core.moe`` on ``config``; False when it refuses the config (a MaecError)."""
    from maec_core.errors import MaecError
    from maec_core.moe.build import build_moe
    from maec_core.moe.config import parse_moe_config

    try:
        build_moe(parse_moe_config(config), out)
    except MaecError:
        return False
    return True


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def config_json(folder: Path) -> dict[str, Any]:
    doc = json.loads((folder / "config.json").read_text())
    return {k: v for k, v in doc.items() if k not in VOLATILE_CONFIG_KEYS}


@dataclass
class Outcome:
    case: str
    ours_accepted: bool
    theirs_accepted: bool
    equal: bool
    problems: list[str] = field(default_factory=list)


def _router(name: str) -> bool:
    return name.endswith(("mlp.gate.weight", "mlp.shared_expert_gate.weight"))


def _random_rows_ok(ours: torch.Tensor, theirs: torch.Tensor) -> str | None:
    """N(0, 1) draws, cast: both means near 0 and deviations near 1 for their size."""
    for who, t in (("ours", ours), ("mergekit's", theirs)):
        x = t.float()
        slack = 6 / math.sqrt(x.numel())
        if abs(float(x.mean())) > 6 * slack or abs(float(x.std()) - 1) > 0.5:
            return f"{who} router rows are not N(0, 1) draws (mean {float(x.mean()):.3f}, " \
                   f"std {float(x.std()):.3f})"
    return None


def compare(ours: Path, theirs: Path, expect: str) -> list[str]:
    """Problems found between the two outputs (empty: conforming)."""
    problems: list[str] = []
    a, b = tensors(ours), tensors(theirs)
    if set(a) != set(b):
        problems.append(f"tensor names differ: only ours {sorted(set(a) - set(b))[:4]}, "
                        f"only mergekit's {sorted(set(b) - set(a))[:4]}")
    for name in sorted(set(a) & set(b)):
        x, y = a[name], b[name]
        if x.dtype != y.dtype or x.shape != y.shape:
            problems.append(f"{name}: {x.dtype} {list(x.shape)} vs {y.dtype} {list(y.shape)}")
        elif expect == "random" and _router(name):
            why = _random_rows_ok(x, y)
            if why:
                problems.append(f"{name}: {why}")
        elif not torch.equal(x, y):
            diff = float((x.float() - y.float()).abs().max())
            problems.append(f"{name}: differs (max |diff| {diff:.3g})")
    if config_json(ours) != config_json(theirs):
        ca, cb = config_json(ours), config_json(theirs)
        keys = sorted(k for k in set(ca) | set(cb) if ca.get(k) != cb.get(k))
        problems.append(f"config.json differs in {keys}")
    return problems


def run_case(case: Case, models: dict[str, Path], work: Path) -> Outcome:
    config = case.config(models)
    ours, theirs = work / f"{case.name}-ours", work / f"{case.name}-mergekit"
    mine, ref = run_ours(config, ours), run_mergekit(config, theirs)
    if not (mine and ref):
        agree = mine == ref
        return Outcome(case.name, mine, ref, agree and case.expect == "refused",
                       [] if agree else ["one tool accepted, the other refused"])
    problems = compare(ours, theirs, case.expect)
    return Outcome(case.name, True, True, not problems, problems)


def moe_conformance(work: Path) -> list[Outcome]:
    """Every case through both tools; ``len(outcomes)`` is ``moe_configs`` and the count
    of ``outcome.equal`` is ``moe_equal`` (equal: both refused, or both accepted and
    conforming)."""
    families: dict[tuple[str, torch.dtype], dict[str, Path]] = {}
    outcomes = []
    for case in CASES:
        key = (case.family, case.dtype)
        if key not in families:
            families[key] = make_family(work / f"{case.family}-{str(case.dtype)[6:]}",
                                        case.family, case.dtype)
        outcomes.append(run_case(case, families[key], work))
    return outcomes


def moe_result_fields(work: Path) -> dict[str, int]:
    """``{"moe_configs": N, "moe_equal": N}`` for the conformance RESULT line."""
    outcomes = moe_conformance(work)
    return {"moe_configs": len(outcomes), "moe_equal": sum(o.equal for o in outcomes)}
