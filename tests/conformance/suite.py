"""Conformance with mergekit: mergekit's own recipes through both tools, side by side.

Each YAML file under ``recipes/`` transcribes one configuration from mergekit's
``examples/`` or one its test suite builds (the comment at its top says which), with
``${name}`` where a model path goes; :class:`tests.conformance.models.ModelFarm` builds
the tiny local checkpoint each name stands for (Llama, Mistral, Qwen2, Gemma, Phi,
Phi-3, GPT-2, Granite; tokenizer fixtures; a LoRA adapter).

A recipe runs through our engine and through mergekit 0.1.5's own merge (its Python
API, in-process, CPU, with ``mergekit-yaml``'s default options). The two must agree on
accepting or refusing it. Where both accept: the same tensor names, dtypes and shapes,
values within the saved dtype's rounding at the tensor's own scale, the same
config.json (besides the writer's version), the same vocabulary and chat template,
and transformers loads both. Recipes whose masks are random (DARE, DELLA) are compared
by statistics instead: the fraction of the delta kept and its norm.

Used by ``tests/conformance/test_conformance.py`` (a fast subset) and
``bench/conformance.py`` (every recipe).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file

from tests.conformance.models import ModelFarm
from tests.factories import run_recipe

RECIPES = Path(__file__).parent / "recipes"
# Allowed max |ours - theirs| as a fraction of the reference tensor's largest entry: a
# few units in the last place of the saved dtype (the tools round at different steps,
# and float32 sums in a different order differ in the last bits).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2.0**-9, torch.bfloat16: 2.0**-6}
# Methods whose drop masks are random draws (mergekit's are unseeded): compared by
# statistics, not element by element.
RANDOM_METHODS = {"dare_ties", "dare_linear", "della", "della_linear"}
# config.json keys that name the writer, not the model.
CONFIG_IGNORED = {"transformers_version", "_name_or_path"}
# Recipes run by `make test` (the rest by `make bench-conformance` only): one per
# method family and per cause of past disagreement, chosen to stay fast.
FAST = {"basic_linear", "basic_ties", "basic_slerp", "example_gpt2_small",
        "params_top_level_density", "tok_pad_to_multiple_of", "example_bio_merge",
        "basic_passthrough_scale", "example_gradient_slerp", "arch_mistral3_modules_slerp",
        "method_sce_fp16", "basic_model_stock_filterwise",
        # Recipes from model cards that mergekit accepts and were once refused here (an
        # unknown top-level key, `modules: default` on a one-stack model, a tokenizer
        # donor, vocabularies that differ by added tokens in slices) or saved in another
        # dtype (arcee_fusion, ramplus_tl), and union vocabularies whose base adds tokens.
        "accept_unknown_top_level_key", "accept_modules_default_llama",
        "accept_modules_default_models", "accept_tokenizer_donor",
        "accept_passthrough_added_tokens", "accept_slices_added_tokens_linear",
        "example_arcee_fusion", "method_ramplus_tl_bf16", "tok_union_task_arithmetic",
        "tok_union_task_arithmetic_bf16", "tok_union_ties"}
# Recipes whose outputs are known to differ, and why (docs/compatibility.md has the
# evidence). Not hidden: the test expects them to fail and the benchmark counts them.
KNOWN_DIFFERENCES: dict[str, str] = {
    "arch_qwen2_frankenmerge": "mergekit 0.1.5 cannot write the config (it changes "
                               "num_hidden_layers, not layer_types); ours writes both "
                               "and transformers loads it",
    "accept_passthrough_added_tokens": "mergekit copies the 66-row head of the last slice's "
                                       "model under a 64-token config (transformers cannot "
                                       "load it); ours lays its rows out in the output's "
                                       "vocabulary: the same 64 rows",
    "accept_slices_added_tokens_linear": "mergekit copies the 64-row head of the last "
                                         "slice's model under a 66-token config "
                                         "(transformers cannot load it); ours: the same 64 "
                                         "rows, zeros for the two tokens that model lacks",
}
# The recipes above whose vocabulary tensors differ from mergekit's only by the rows of
# tokens one side lacks (test_conformance checks every row both have).
ROW_LAYOUT_DIFFERENCES = ("accept_passthrough_added_tokens",
                          "accept_slices_added_tokens_linear")


def recipe_files(only_fast: bool = False) -> list[Path]:
    files = sorted(RECIPES.glob("*.yaml"))
    return [p for p in files if p.stem in FAST] if only_fast else files


def placeholders(path: Path) -> list[str]:
    return sorted(set(re.findall(r"\$\{(\w+)\}", path.read_text())))


def load_recipe(path: Path, farm: ModelFarm) -> dict[str, Any]:
    text = string.Template(path.read_text()).substitute(farm.mapping(placeholders(path)))
    data = yaml.safe_load(text)
    assert isinstance(data, dict)
    return data


@dataclass
class Verdict:
    """One tool's answer: accepted (wrote a model) or refused, and why."""

    accepted: bool
    reason: str = ""


@dataclass
class Outcome:
    recipe: str
    method: str
    ours: Verdict
    theirs: Verdict
    tensor_equal: bool = False
    statistical: bool = False
    max_abs_diff: float = 0.0
    tensors: int = 0
    problems: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)  # config, tokenizer, loading

    @property
    def agree(self) -> bool:
        return self.ours.accepted == self.theirs.accepted

    @property
    def passed(self) -> bool:
        """Both refuse, or both accept with equal tensors and equal other files."""
        if not self.agree:
            return False
        return not self.ours.accepted or (self.tensor_equal and not self.other)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def run_mergekit(recipe: dict[str, Any], out: Path) -> Verdict:
    """mergekit 0.1.5's merge of ``recipe`` with mergekit-yaml's default options."""
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    try:
        config = MergeConfiguration.model_validate(recipe)
        with contextlib.redirect_stdout(io.StringIO()):
            # A LoRA donor needs somewhere to put its merged copy (--lora-merge-cache).
            run_merge(config, str(out), MergeOptions(
                quiet=True, lora_merge_cache=str(out.parent / "lora-merge-cache")))
    except Exception as exc:  # mergekit refuses with bare exceptions of every kind
        return Verdict(False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                       if str(exc) else type(exc).__name__)
    return Verdict(True)


def run_ours(recipe: dict[str, Any], out: Path) -> Verdict:
    from maec_core.errors import MaecError

    try:
        run_recipe(recipe, out)
    except MaecError as exc:
        return Verdict(False, f"{exc.code}: {str(exc).splitlines()[0][:200]}")
    except Exception as exc:  # counted as a refusal, but named as the crash it is
        return Verdict(False, f"CRASH {type(exc).__name__}: {exc}"[:200])
    return Verdict(True)


def compare_tensors(mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]
                    ) -> tuple[list[str], float]:
    problems: list[str] = []
    if sorted(mine) != sorted(ref):
        problems.append(f"tensor names differ: only ours {sorted(set(mine) - set(ref))[:4]}, "
                        f"only mergekit {sorted(set(ref) - set(mine))[:4]}")
    worst = 0.0
    for key in sorted(set(mine) & set(ref)):
        got, want = mine[key], ref[key]
        if got.dtype != want.dtype or got.shape != want.shape:
            problems.append(f"{key}: ours {got.dtype} {list(got.shape)}, mergekit "
                            f"{want.dtype} {list(want.shape)}")
            continue
        diff = float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
        worst = max(worst, diff)
        allowed = TOLERANCE.get(want.dtype, 0.0) * float(want.double().abs().max()) + 1e-12
        if diff > allowed:
            problems.append(f"{key}: max abs diff {diff:.3g} > {allowed:.3g}")
    return problems, worst


def compare_statistics(mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                       base: dict[str, torch.Tensor]) -> list[str]:
    """Random masks: over all of a model's deltas from the base, the fraction of entries
    kept (changed) and the delta's norm must agree (within sampling noise), and so must
    the mean and variance of the result."""
    problems = [f"tensor names differ: {sorted(set(mine) ^ set(ref))[:4]}"] \
        if sorted(mine) != sorted(ref) else []
    keys = [k for k in sorted(set(mine) & set(ref) & set(base))
            if mine[k].shape == ref[k].shape == base[k].shape]
    stats = []
    for out in (mine, ref):
        deltas = torch.cat([(out[k].double() - base[k].double()).flatten() for k in keys])
        values = torch.cat([out[k].double().flatten() for k in keys])
        stats.append((float((deltas != 0).double().mean()), float(deltas.norm()),
                      float(values.mean()), float(values.var())))
    (kept_o, norm_o, mean_o, var_o), (kept_t, norm_t, mean_t, var_t) = stats
    if abs(kept_o - kept_t) > 0.02:
        problems.append(f"kept fraction: ours {kept_o:.4f}, mergekit {kept_t:.4f}")
    if abs(norm_o - norm_t) > 0.05 * max(norm_t, 1e-12):
        problems.append(f"delta norm: ours {norm_o:.4g}, mergekit {norm_t:.4g}")
    if abs(var_o - var_t) > 0.02 * var_t or abs(mean_o - mean_t) > 0.05 * var_t ** 0.5:
        problems.append(f"mean/var: ours {mean_o:.4g}/{var_o:.4g}, mergekit "
                        f"{mean_t:.4g}/{var_t:.4g}")
    return problems


def _config(folder: Path) -> dict[str, Any]:
    data = json.loads((folder / "config.json").read_text())
    return {k: v for k, v in data.items() if k not in CONFIG_IGNORED}


def compare_other(ours: Path, theirs: Path) -> list[str]:
    """config.json, the tokenizer's vocabulary and chat template, and loading."""
    from transformers import AutoConfig, AutoTokenizer

    from tests.conformance.models import model_class

    problems = []
    mine, ref = _config(ours), _config(theirs)
    for key in sorted(set(mine) | set(ref)):
        if mine.get(key) != ref.get(key):
            problems.append(f"config.json {key}: ours {mine.get(key)!r}, mergekit "
                            f"{ref.get(key)!r}")
    toks = []
    for folder in (ours, theirs):
        try:
            tok = AutoTokenizer.from_pretrained(folder)
            toks.append((tok.get_vocab(), _rendered(tok)))
        except Exception as exc:  # no tokenizer files, or unreadable ones
            toks.append((f"no tokenizer ({type(exc).__name__})", None))
    if toks[0][0] != toks[1][0]:
        problems.append("tokenizer vocabularies differ" if isinstance(toks[0][0], dict)
                        and isinstance(toks[1][0], dict) else
                        f"tokenizer: ours {str(toks[0][0])[:60]}, mergekit {str(toks[1][0])[:60]}")
    if toks[0][1] != toks[1][1]:
        problems.append("chat templates differ")
    for who, folder in (("ours", ours), ("mergekit", theirs)):
        try:
            model_class(AutoConfig.from_pretrained(folder)).from_pretrained(folder)
        except Exception as exc:
            problems.append(f"transformers cannot load {who}: {type(exc).__name__}: "
                            f"{str(exc)[:120]}")
    return problems


# A conversation both tools' chat templates render: templates are compared by what they
# produce (the named ones are written independently, so their text differs).
CONVERSATION = [{"role": "user", "content": "Hi there "},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Add 2 and 3."}]


def _rendered(tok: Any) -> str | None:
    if not tok.chat_template:
        return None
    return str(tok.apply_chat_template(CONVERSATION, tokenize=False,
                                       add_generation_prompt=True))


def _base_tensors(recipe: dict[str, Any]) -> dict[str, torch.Tensor]:
    base = recipe.get("base_model")
    return _tensors(Path(str(base))) if base else {}


def run_one(path: Path, farm: ModelFarm, work: Path) -> Outcome:
    """Run one recipe file through both tools under ``work`` and compare."""
    recipe = load_recipe(path, farm)
    method = str(recipe.get("merge_method", "")).lower()
    ours, theirs = work / f"{path.stem}-ours", work / f"{path.stem}-mergekit"
    outcome = Outcome(path.stem, method, run_ours(recipe, ours), run_mergekit(recipe, theirs))
    if not (outcome.ours.accepted and outcome.theirs.accepted):
        return outcome
    mine, ref = _tensors(ours), _tensors(theirs)
    outcome.tensors = len(ref)
    random = method in RANDOM_METHODS and _any_density_below_one(recipe)
    if random:
        outcome.statistical = True
        outcome.problems = compare_statistics(mine, ref, _base_tensors(recipe))
        outcome.max_abs_diff = 0.0
    else:
        outcome.problems, outcome.max_abs_diff = compare_tensors(mine, ref)
    outcome.tensor_equal = not outcome.problems
    outcome.other = compare_other(ours, theirs)
    return outcome


def _any_density_below_one(recipe: dict[str, Any]) -> bool:
    """Whether any density in the recipe (at any level) is below 1: a random mask."""
    found: list[float] = []

    def walk(node: Any, key: str = "") -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, k if k != "value" else key)
        elif isinstance(node, list):
            for v in node:
                walk(v, key)
        elif key == "density" and isinstance(node, int | float):
            found.append(float(node))

    walk(recipe)
    return not found or any(d < 1 for d in found)
